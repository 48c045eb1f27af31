"""HTTP only, in rooms: the app factory (app.py), the API surfaces (api/: OpenAI chat and completions, Responses,
Anthropic's Messages, embeddings, choices, feedback, token sessions, admin, playground), every route's three steps
(resolve.py -> plan.py -> reply.py), OpenAI's chat wire format (wire/), and what every surface shares (gateway/:
the front door, the typed request context, keys, limits, shared state, accounting, metrics, tracing, errors)."""
