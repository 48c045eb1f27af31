"""ReasonFormer checkpoints: ``config.json`` + ``reasonformer.safetensors`` beside a reference to the base;
retrofitting a fresh one (``derive: {family: reasonformer}``). The storage is the one MoDr uses
(families/checkpoint.py: `OverBase`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from chorus.engines.families.checkpoint import OverBase
from chorus.engines.families.reasonformer.config import MODEL_TYPE, WEIGHTS, ReasonFormerConfig
from chorus.engines.families.reasonformer.model import ReasonFormerModel

REASONFORMER = OverBase(
    "reasonformer", MODEL_TYPE, "ReasonFormer", WEIGHTS, ReasonFormerConfig, ReasonFormerModel,
    describe=lambda cfg: (f"representation {list(cfg.representation)}, block {list(cfg.block)}, coda "
                          f"{list(cfg.coda)}, skills {', '.join(cfg.skills)} ({cfg.kind}), top_k {cfg.top_k}, "
                          f"max_steps {cfg.max_steps}"))


def load_base_model(path: Path | str, dtype: torch.dtype = torch.float32) -> Any:
    return REASONFORMER.load_base_model(path, dtype)


def is_reasonformer_dir(path: Path | str) -> bool:
    return REASONFORMER.is_dir(path)


def save_reasonformer(model: ReasonFormerModel, out: Path, *, extra: dict[str, Any] | None = None) -> None:
    REASONFORMER.save(model, out, extra=extra)


def load_reasonformer(path: Path | str, dtype: torch.dtype = torch.float32) -> ReasonFormerModel:
    model: ReasonFormerModel = REASONFORMER.load(path, dtype)
    return model


def build_retrofit(base_dir: Path | str, out: Path | str, options: dict[str, Any] | None = None, *,
                   force: bool = False, seed: int = 0, log: Any = print) -> Path:
    """A fresh ReasonFormer checkpoint (skills untrained: zero LoRA B, uniform router, closed gates); ``options``
    as `ReasonFormerConfig.from_options` takes them."""
    return REASONFORMER.retrofit(base_dir, out, options, force=force, seed=seed, log=log)
