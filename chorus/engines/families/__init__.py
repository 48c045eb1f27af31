"""Model families served natively: MoE (``moe*.py``, Switch / GShard / DeepSeek routing), grafting
(``graft.py``), MoDr and ReasonFormer (packages that store their weights over a base the same way:
``checkpoint.OverBase``), the DUMA scorer (``duma.py``); how a derived model is built (``builders.py``: the
families ``derive:`` may name) and what the builders share (``checkpoint.py``). Imports no engine kind."""
