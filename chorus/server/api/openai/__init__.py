"""OpenAI's chat and text completions (routes.py, and the fast path that serves them), and what is served:
``/v1/models``, ``/health``, ``/metrics`` (models.py). Their wire format is server/wire/."""
