"""MoDr checkpoints: ``config.json`` + ``modr.safetensors`` beside a reference to the base; retrofitting a fresh
one (``derive: {family: modr}``). The storage is the one ReasonFormer uses (families/checkpoint.py: `OverBase`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from chorus.engines.families.checkpoint import OverBase
from chorus.engines.families.modr.config import WEIGHTS, MoDrConfig
from chorus.engines.families.modr.model import MoDrModel

MODR = OverBase("modr", "chorus_modr", "MoDr", WEIGHTS, MoDrConfig, MoDrModel,
                describe=lambda cfg: (f"prelude {list(cfg.prelude)}, core {list(cfg.core)}, coda {list(cfg.coda)}, "
                                      f"{cfg.branches} branches, rank {cfg.rank}"))


def load_base_model(path: Path | str, dtype: torch.dtype = torch.float32) -> Any:
    return MODR.load_base_model(path, dtype)


def is_modr_dir(path: Path | str) -> bool:
    return MODR.is_dir(path)


def save_modr(model: MoDrModel, out: Path, *, extra: dict[str, Any] | None = None) -> None:
    MODR.save(model, out, extra=extra)


def load_modr(path: Path | str, dtype: torch.dtype = torch.float32, **overrides: Any) -> MoDrModel:
    """Serving settings in ``overrides`` (recurrence, max_recurrence, kv_share) replace the checkpoint's."""
    model: MoDrModel = MODR.load(path, dtype, **overrides)
    return model


def build_retrofit(base_dir: Path | str, out: Path | str, options: dict[str, Any] | None = None, *,
                   force: bool = False, seed: int = 0, log: Any = print) -> Path:
    """A fresh MoDr checkpoint (branches untrained); ``options`` as `MoDrConfig.from_options` takes them."""
    return MODR.retrofit(base_dir, out, options, force=force, seed=seed, log=log)
