"""The API surfaces, grouped by whose API they are: OpenAI's (openai/), Anthropic's (anthropic/) and chorus's own
(extensions/); one module or sub-package per surface (server/app.py lists their routers). Each route runs
resolve, plan, reply (server/resolve.py, plan.py, reply.py)."""
