"""MoDr checkpoints: ``config.json`` + ``modr.safetensors`` beside a reference to the base; retrofitting."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from chorus.engines.families.checkpoint import (
    MANIFEST,
    atomic_output,
    check_llama,
    check_new_dir,
    copy_tokenizer,
    read_config,
)
from chorus.engines.families.modr.config import WEIGHTS, MoDrConfig
from chorus.engines.families.modr.model import MoDrModel
from chorus.errors import BuildError


def load_base_model(path: Path | str, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForCausalLM

    path = Path(path).expanduser()
    check_llama(read_config(path), path, "MoDr")
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()


def is_modr_dir(path: Path | str) -> bool:
    try:
        return json.loads((Path(path) / "config.json").read_text()).get("model_type") == "chorus_modr"
    except (OSError, ValueError):
        return False


def save_modr(model: MoDrModel, out: Path, *, extra: dict[str, Any] | None = None) -> None:
    """Write config + branch weights into ``out`` (an existing empty directory) and the tokenizer files."""
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().clone() for k, v in model.state_tensors().items()}, str(out / WEIGHTS),
              metadata={"format": "pt"})
    base = Path(model.cfg.base)
    config = {"model_type": "chorus_modr", "architectures": ["MoDrModel"], "modr": model.cfg.to_json(),
              "base": str(base), "base_model_type": model.config.model_type,
              "hidden_size": model.config.hidden_size, "vocab_size": model.config.vocab_size, **(extra or {})}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if base.is_dir():
        copy_tokenizer(base, out)
    files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file() and p.name != MANIFEST}
    (out / MANIFEST).write_text(json.dumps({"family": "modr", "base": str(base), "files": files}, indent=2))


def load_modr(path: Path | str, dtype: torch.dtype = torch.float32, **overrides: Any) -> MoDrModel:
    from safetensors.torch import load_file

    path = Path(path).expanduser()
    config = read_config(path)
    if config.get("model_type") != "chorus_modr":
        raise BuildError(f"{path} is not a MoDr checkpoint (model_type {config.get('model_type')!r})")
    cfg = MoDrConfig.from_json({**config["modr"], **overrides})
    base_dir = Path(config["base"])
    if not base_dir.is_absolute():
        base_dir = (path / base_dir).resolve()
    if not (base_dir / "config.json").is_file():
        raise BuildError(f"{path}: its base checkpoint {base_dir} is missing")
    base = load_base_model(base_dir, dtype)
    if base.config.hidden_size != config.get("hidden_size", base.config.hidden_size):
        raise BuildError(f"{path}: base {base_dir} has hidden size {base.config.hidden_size}, "
                         f"the branches were built for {config['hidden_size']}")
    cfg.base = str(base_dir)
    model = MoDrModel(base, cfg)
    model.load_state_tensors(load_file(path / WEIGHTS))
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
