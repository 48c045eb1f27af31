"""MoDr checkpoints: ``config.json`` + ``modr.safetensors`` beside a reference to the base; retrofitting."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from chorus.engines.families.checkpoint import (
    atomic_output,
    check_llama,
    check_new_dir,
    load_llama_model,
    load_over_base,
    model_type_of,
    read_config,
    save_over_base,
)
from chorus.engines.families.modr.config import WEIGHTS, MoDrConfig
from chorus.engines.families.modr.model import MoDrModel


def load_base_model(path: Path | str, dtype: torch.dtype = torch.float32) -> Any:
    return load_llama_model(path, "MoDr", dtype)


def is_modr_dir(path: Path | str) -> bool:
    return model_type_of(path) == "chorus_modr"


def save_modr(model: MoDrModel, out: Path, *, extra: dict[str, Any] | None = None) -> None:
    """Write config + branch weights into ``out`` (an existing empty directory) and the tokenizer files."""
    save_over_base(
        out,
        family="modr",
        model_type="chorus_modr",
        cfg=model.cfg.to_json(),
        base_config=model.config,
        tensors=model.state_tensors(),
        weights=WEIGHTS,
        extra={"architectures": ["MoDrModel"], **(extra or {})},
    )


def load_modr(path: Path | str, dtype: torch.dtype = torch.float32, **overrides: Any) -> MoDrModel:
    from safetensors.torch import load_file

    config, base_dir, base = load_over_base(path, model_type="chorus_modr", what="MoDr", dtype=dtype)
    cfg = MoDrConfig.from_json({**config["modr"], **overrides})
    cfg.base = str(base_dir)
    model = MoDrModel(base, cfg)
    model.load_state_tensors(load_file(Path(path).expanduser() / WEIGHTS))
    for p in model.parameters():  # serving: nothing trains (chorus train modr turns the branches back on)
        p.requires_grad_(False)
    return model.to(dtype).eval()


def build_retrofit(base_dir: Path | str, out: Path | str, options: dict[str, Any] | None = None, *,
                   force: bool = False, seed: int = 0, log: Any = print) -> Path:
    """A fresh MoDr checkpoint retrofitted from a Llama-architecture base (branches untrained); ``options``
    as `MoDrConfig.from_options` takes them."""
    base_dir = Path(base_dir).expanduser().resolve()
    out = check_new_dir(out, force)
    config = read_config(base_dir)
    check_llama(config, base_dir, "MoDr retrofit")
    cfg = MoDrConfig.from_options(int(config["num_hidden_layers"]), options or {})
    cfg.base = str(base_dir)
    cfg.check(int(config["num_hidden_layers"]))
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    model = MoDrModel(load_base_model(base_dir), cfg)
    with atomic_output(out, force) as tmp:
        save_modr(model, tmp, extra={"seconds": round(time.perf_counter() - t0, 1)})
    log(f"retrofitted {base_dir.name} into MoDr (prelude {list(cfg.prelude)}, core {list(cfg.core)}, "
        f"coda {list(cfg.coda)}, {cfg.branches} branches, rank {cfg.rank}) at {out}")
    return out
