"""What every engine kind shares: the Engine / Session protocol (base), sampling and picks, detokenizing,
constraints and tool calls, the generation loop of token-level engines, multiple-choice scoring, tokenizers,
packaged model sources, a model's config entry (spec) and the registry of engine kinds. Imports no kind."""
