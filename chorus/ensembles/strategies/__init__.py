"""The text-level strategies, one module each (registered by name in ensembles/base.py's ``STRATEGIES``):
answer_vote, consistency_select, cascade (answer-side: they draw through ensembles/drawing.py and decide with
ensembles/answers/), crowd_vote, exchange_of_thought, mixture_of_agents, route (through ensembles/routers/),
select and choice_average (multiple-choice scores). The token-level strategy is ensembles/logit_average/. A
strategy imports no other strategy (an import contract says so)."""
