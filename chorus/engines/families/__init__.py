"""Model families served natively (MoE, MoDr, grafting, ...): one module per family."""
