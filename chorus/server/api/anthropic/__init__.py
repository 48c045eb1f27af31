"""Anthropic's Messages API: the request read as a chat request (wire.py), the chat reply given back as a message
(render.py), the routes (routes.py)."""
