"""OpenAI's Responses API: the request read as a chat request (wire.py), the chat reply given back as a response
(render.py), the routes and stored responses (routes.py; the store itself is gateway/stored_responses.py)."""
