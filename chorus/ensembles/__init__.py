"""Strategies over engines, one module (or package) each, in one registry (base.py: `STRATEGIES`): logit averaging
(``logit_average/``), answer votes, consistency selection, cascades, routing (``route.py`` over ``routers/``, a
registry of its own), Exchange-of-Thought, crowd voting, mixture-of-agents, learned selection. Answer types and
extraction live here once (``answer_types.py``, ``answers.py``); so do the similarity measures and the trained
artifacts the strategies serve. Nothing here imports FastAPI."""
