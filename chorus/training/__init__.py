"""Training loops and their data: MoE (Switch / GShard / DeepSeek routers), MoDr, ReasonFormer, the DUMA
scorer. A layer above engines: it trains the model code of ``chorus.engines.families`` and imports nothing
of the server or the strategies."""
