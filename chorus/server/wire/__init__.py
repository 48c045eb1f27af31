"""OpenAI's chat and completion wire format, the server's common language: every generating surface (OpenAI's
chat and completions, the Responses API, Anthropic's Messages API) is read into these request models and its reply
rendered from these shapes (request.py apart from render.py and the stream's events.py)."""
