"""ReasonFormer checkpoints: ``config.json`` + ``reasonformer.safetensors`` beside a reference to the base;
retrofitting a fresh one (``derive: {family: reasonformer}``)."""

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
from chorus.engines.families.reasonformer.config import MODEL_TYPE, WEIGHTS, ReasonFormerConfig
from chorus.engines.families.reasonformer.model import ReasonFormerModel


def load_base_model(path: Path | str, dtype: torch.dtype = torch.float32) -> Any:
    return load_llama_model(path, "ReasonFormer", dtype)


def is_reasonformer_dir(path: Path | str) -> bool:
    return model_type_of(path) == MODEL_TYPE


def save_reasonformer(model: ReasonFormerModel, out: Path, *, extra: dict[str, Any] | None = None) -> None:
    """Write config + trained weights into ``out`` (an existing empty directory) and the tokenizer files."""
    save_over_base(out, family="reasonformer", model_type=MODEL_TYPE, cfg=model.cfg.to_json(),
                   base_config=model.config, tensors=model.state_tensors(), weights=WEIGHTS,
                   extra={"architectures": ["ReasonFormerModel"], **(extra or {})})


def load_reasonformer(path: Path | str, dtype: torch.dtype = torch.float32) -> ReasonFormerModel:
    from safetensors.torch import load_file

    config, base_dir, base = load_over_base(path, model_type=MODEL_TYPE, what="ReasonFormer", dtype=dtype)
    cfg = ReasonFormerConfig.from_json(config["reasonformer"])
    cfg.base = str(base_dir)
    model = ReasonFormerModel(base, cfg)
    model.load_state_tensors(load_file(Path(path).expanduser() / WEIGHTS))
    for p in model.parameters():  # serving: nothing trains
        p.requires_grad_(False)
    return model.to(dtype).eval()


def build_retrofit(base_dir: Path | str, out: Path | str, options: dict[str, Any] | None = None, *,
                   force: bool = False, seed: int = 0, log: Any = print) -> Path:
    """A fresh ReasonFormer checkpoint retrofitted from a Llama-architecture base (skills untrained: zero
    LoRA B, uniform router, closed gates); ``options`` as `ReasonFormerConfig.from_options` takes them."""
    base_dir = Path(base_dir).expanduser().resolve()
    out = check_new_dir(out, force)
    config = read_config(base_dir)
    check_llama(config, base_dir, "ReasonFormer retrofit")
    n = int(config["num_hidden_layers"])
    cfg = ReasonFormerConfig.from_options(n, options or {})
    cfg.base = str(base_dir)
    cfg.check(n)
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    model = ReasonFormerModel(load_base_model(base_dir), cfg)
    with atomic_output(out, force) as tmp:
        save_reasonformer(model, tmp, extra={"seconds": round(time.perf_counter() - t0, 1)})
    log(f"retrofitted {base_dir.name} into ReasonFormer (representation {list(cfg.representation)}, block "
        f"{list(cfg.block)}, coda {list(cfg.coda)}, skills {', '.join(cfg.skills)} ({cfg.kind}), top_k {cfg.top_k}, "
        f"max_steps {cfg.max_steps}) at {out}")
    return out
