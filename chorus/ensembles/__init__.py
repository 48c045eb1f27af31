"""Strategies over engines, in one registry (base.py: `STRATEGIES`): the text-level strategies in ``strategies/``
(answer votes, consistency selection, cascades, routing over ``routers/``, Exchange-of-Thought, crowd voting,
mixture-of-agents, learned selection, choice averaging), logit averaging in ``logit_average/``. What they share
has a room each: drawing samples (``drawing.py``), the answer machinery (``answers/``: extraction, kinds, votes,
confidence, the decision rules) and the fitted artifacts they serve (``fitted/``). Nothing here imports FastAPI."""
