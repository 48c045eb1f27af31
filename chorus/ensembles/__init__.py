"""Strategies over engines (logit averaging, Exchange-of-Thought, crowd voting, mixture-of-agents)."""
