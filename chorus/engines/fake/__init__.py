"""The fake engine: deterministic scripted logits and texts, shipped beside the interface for tests and demos."""
