"""HTTP only: the app factory, the APIs (OpenAI chat, completions, Responses, embeddings, choices; the session
API; admin, playground), their request and reply shapes, the one step that resolves a model for a key
(resolve.py), admission, keys, limits, shared state, metrics and the exception -> HTTP map."""
