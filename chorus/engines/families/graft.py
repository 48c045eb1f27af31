"""SOLAR-style depth up-scaling ("grafting"), docs/methods.md §7.

From an n-layer base: copy A keeps layers [0, n-m), copy B keeps layers [m, n); stacking A then B
gives 2(n-m) layers. Embeddings, final norm and head come from the base. The result is a standard
checkpoint of the base's architecture (transformers and vLLM load it unchanged), tensor for tensor
what mergekit's ``passthrough`` merge with the slices ``[0, n-m]`` and ``[m, n]`` writes; the
matching mergekit recipe is saved beside it (``mergekit.yaml``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chorus.engines.families.checkpoint import (
    Base,
    atomic_output,
    check_new_dir,
    copy_tokenizer,
    load_base,
    save_checkpoint,
)
from chorus.errors import BuildError


@dataclass(frozen=True)
class GraftConfig:
    drop: int  # m: layers dropped from the end of copy A and from the start of copy B

    @classmethod
    def tiny(cls) -> GraftConfig:
        return cls(drop=1)

    def check(self, n_layers: int) -> None:
        if not 1 <= self.drop < n_layers:
            raise BuildError(
                f"--drop must be between 1 and {n_layers - 1} for a {n_layers}-layer base (got {self.drop})"
            )

    def source_layers(self, n_layers: int) -> list[int]:
        """The base layer behind each layer of the grafted model."""
        self.check(n_layers)
        return list(range(0, n_layers - self.drop)) + list(range(self.drop, n_layers))


def mergekit_recipe(base: Path, n_layers: int, drop: int) -> str:
    return (f"# the same checkpoint with mergekit: mergekit-yaml mergekit.yaml OUT\n"
            f"merge_method: passthrough\ndtype: float32\nslices:\n"
            f"  - sources:\n      - model: {base}\n        layer_range: [0, {n_layers - drop}]\n"
            f"  - sources:\n      - model: {base}\n        layer_range: [{drop}, {n_layers}]\n")


def graft_tensors(base: Base, cfg: GraftConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    src = cfg.source_layers(base.n_layers)
    tensors = dict(base.outside_layers())
    for new, old in enumerate(src):
        for name, t in base.layer(old).items():
            tensors[f"model.layers.{new}.{name}"] = t
    config = dict(base.config, num_hidden_layers=len(src))
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = [base.config["layer_types"][i] for i in src]
    return config, tensors


def build_graft(base_dir: Path | str, out: Path | str, options: dict[str, Any], *, force: bool = False,
                log: Any = print) -> Path:
    """``derive: {family: graft, options: {...}}``: `graft` with a `GraftConfig` of ``options``."""
    return graft(base_dir, out, GraftConfig(**options), force=force, log=log)


def graft(base_dir: Path | str, out: Path | str, cfg: GraftConfig, *, force: bool = False,
          log: Any = print) -> Path:
    out = check_new_dir(out, force)
    t0 = time.perf_counter()
    base = load_base(base_dir, "graft")
    cfg.check(base.n_layers)
    config, tensors = graft_tensors(base, cfg)
    with atomic_output(out, force) as tmp:
        copy_tokenizer(base.path, tmp)
        (tmp / "mergekit.yaml").write_text(mergekit_recipe(base.path, base.n_layers, cfg.drop))
        save_checkpoint(tmp, config, tensors, {"family": "graft", "base": str(base.path), "drop": cfg.drop,
                                               "layers": config["num_hidden_layers"],
                                               "seconds": round(time.perf_counter() - t0, 1)})
    log(f"grafted {base.n_layers} -> {config['num_hidden_layers']} layers (drop {cfg.drop}) into {out}")
    return out
