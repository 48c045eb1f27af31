"""The transformers configs vLLM reads for MoDr and ReasonFormer checkpoints: the base's Llama config (layers,
heads, rope, vocabulary: what vLLM sizes its KV cache and checks the tokenizer by) with the family's settings on
top (``config.modr`` / ``config.reasonformer``) and ``base_dir``, the directory of the base's weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig


class OverBaseConfig(PretrainedConfig):
    """A family checkpoint over a base: its config.json (``base``: the base's directory, as chorus writes it:
    absolute) completed with the base's config.json."""

    family = ""

    def __post_init__(self, **kwargs: Any) -> None:  # transformers' configs are dataclasses: extra keys land here
        if "base" in kwargs and "num_hidden_layers" not in kwargs:  # read from disk (not a copy of this config)
            base_dir = Path(kwargs["base"]).expanduser().resolve()
            if not (base_dir / "config.json").is_file():
                raise ValueError(f"a {self.model_type} checkpoint's base {base_dir} is missing (config.json's "
                                 "'base'): mount or copy the base checkpoint there")
            base = json.loads((base_dir / "config.json").read_text())
            if base.get("model_type") != "llama":
                raise ValueError(f"the base {base_dir} is a {base.get('model_type')!r}, not a Llama checkpoint")
            kwargs = {**{k: v for k, v in base.items() if k not in ("model_type", "architectures")}, **kwargs,
                      "base_dir": str(base_dir)}
        super().__post_init__(**kwargs)


class MoDrHFConfig(OverBaseConfig):
    model_type = "chorus_modr"
    family = "modr"


class ReasonFormerHFConfig(OverBaseConfig):
    model_type = "chorus_reasonformer"
    family = "reasonformer"


CONFIGS: dict[str, type[OverBaseConfig]] = {c.model_type: c for c in (MoDrHFConfig, ReasonFormerHFConfig)}
