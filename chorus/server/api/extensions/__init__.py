"""chorus's own API surfaces, beside OpenAI's (openai/) and Anthropic's (anthropic/): multiple-choice scoring
(``/v1/choices``, choices.py), feedback (``/v1/feedback``, feedback.py), token-level sessions (``/chorus/v1`` and
``/chorus/v2/sessions``, sessions.py), the admin endpoints (admin.py), ``/health`` and ``/metrics`` (ops.py) and
the browser playground (playground/)."""
