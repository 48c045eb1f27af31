"""OpenAI's API: chat and text completions (routes.py, and the fast path that serves them: fastpath.py), the
models list (models.py), embeddings, files and the Batch API (embeddings.py, files.py, batches.py) and the
Responses API (responses/). Their wire format is server/wire/."""
