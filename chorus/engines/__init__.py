"""Where tokens come from. One sub-package per engine kind, each holding its engine, its internals, its options
model and how it is prepared and found ready (``kind.py``); ``core`` holds what every kind shares (the Engine /
Session protocol, sampling, picks, detokenizing, constraints, tool calls, the config entry of a model and the
registry of kinds); ``families`` the model code of MoE, MoDr, grafting, ReasonFormer and DUMA; ``runtime`` what
engines and families share at run time (KV cache, observers, metrics).

Kinds never import each other, and ``core`` never imports a kind (import-linter contracts in pyproject.toml).
Importing this package imports neither transformers nor llama.cpp nor any GPU code; engines load lazily.
"""
