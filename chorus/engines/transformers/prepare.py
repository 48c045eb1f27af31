"""Prepare a model for serving: GGUF -> dequantized safetensors checkpoint in ``$CHORUS_HOME/models``.

Preparing is idempotent (a verified checkpoint is left alone), prints its progress, checks what it
wrote (the reloaded checkpoint must give the same logits as the dequantized GGUF on a probe prompt)
and is atomic: everything is written into a temporary directory beside the target and renamed into
place only after verification, so an interrupted run never leaves a checkpoint that later loads.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from chorus.engines.core.registry import prepare_model
from chorus.engines.core.sources import resolve_gguf
from chorus.engines.core.spec import ModelSpec
from chorus.engines.families.builders import build
from chorus.errors import EngineUnavailable

MANIFEST = "chorus-prepared.json"
PROBE = "The capital of France is"


def _files(d: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(d.iterdir()) if p.is_file() and p.name != MANIFEST}


def is_prepared(d: Path) -> bool:
    """A complete checkpoint: the manifest exists and every file it lists has its recorded size."""
    try:
        manifest = json.loads((d / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    files = manifest.get("files", {})
    return bool(files) and all((d / n).is_file() and (d / n).stat().st_size == s for n, s in files.items())


def prepare_checkpoint(spec: ModelSpec, home: Path, *, force: bool = False, log: Callable[[str], None] = print,
                       models: dict[str, ModelSpec] | None = None) -> Path:
    """Convert ``spec`` into a servable checkpoint; ``models`` resolves a derived model's base by name."""
    if spec.derive is not None:
        return _prepare_derived(spec, home, force, log, models or {})
    if not spec.needs_prepare:
        d = spec.checkpoint_dir(home)
        if not (d / "config.json").is_file():
            raise EngineUnavailable(f"{spec.name}: {d} is not a Hugging Face checkpoint directory (no config.json)")
        log(f"{spec.name}: nothing to prepare ({d})")
        return d
    target = spec.prepared_dir(home)
    if not force and is_prepared(target):
        log(f"{spec.name}: already prepared at {target}")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)  # left by an interrupted run
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    try:
        _convert(spec, home, tmp, log)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"{spec.name}: ready at {target}")
    return target


def _convert(spec: ModelSpec, home: Path, out: Path, log: Callable[[str], None]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    log(f"{spec.name}: [1/4] locating GGUF ({spec.source or spec.path})")
    gguf = resolve_gguf(spec, home)
    log(f"{spec.name}: [2/4] loading and dequantizing {gguf.name} ({gguf.stat().st_size / 2**20:.0f} MiB)")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF-loaded model counts as quantized and refuses save_pretrained: rebuild it from its config.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    missing = [k for k in missing if k not in getattr(model, "_tied_weights_keys", {})]
    if missing or unexpected:
        raise EngineUnavailable(
            f"{spec.name}: state dict mismatch (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    model.tie_weights()
    log(f"{spec.name}: [3/4] writing safetensors to {out}")
    out.mkdir(parents=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    log(f"{spec.name}: [4/4] verifying the written checkpoint")
    probe = tok(PROBE, return_tensors="pt")
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.inference_mode():
        want = quantized(**probe).logits
        got = reloaded(**probe).logits
    diff = float((want - got).abs().max())
    if diff > 1e-4:
        raise EngineUnavailable(f"{spec.name}: verification failed, reloaded logits differ by {diff:.2e}")
    manifest = {
        "name": spec.name, "source": spec.source or spec.path, "gguf": str(gguf),
        "probe_max_abs_diff": diff, "seconds": round(time.perf_counter() - t0, 1), "files": _files(out),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))


def _prepare_derived(spec: ModelSpec, home: Path, force: bool, log: Callable[[str], None],
                     models: dict[str, ModelSpec]) -> Path:
    """Build a derived checkpoint (MoE upcycle, graft, MoDr / ReasonFormer retrofit) from its base, preparing the
    base first."""
    from chorus.errors import BuildError

    derive = spec.derive
    assert derive is not None
    target = spec.prepared_dir(home)
    wanted = derive.model_dump()
    if not force and is_prepared(target) and json.loads((target / MANIFEST).read_text()).get("derive") == wanted:
        log(f"{spec.name}: already prepared at {target}")
        return target
    if derive.base in models:
        if derive.base == spec.name:
            raise EngineUnavailable(f"{spec.name}: a model cannot be derived from itself")
        base_dir = prepare_model(models[derive.base], home, log=log, models=models)  # the base's own kind
    else:
        base_dir = Path(derive.base).expanduser()
        if not base_dir.is_dir():
            raise EngineUnavailable(f"{spec.name}: derive.base {derive.base!r} is neither a model of this config "
                                    f"({', '.join(sorted(models)) or 'none'}) nor a checkpoint directory")
    log(f"{spec.name}: building ({derive.family}) from {base_dir}")
    try:
        build(derive.family, base_dir, target, derive.options, log)
    except BuildError as exc:
        raise EngineUnavailable(f"{spec.name}: {exc}") from None
    except TypeError as exc:  # an unknown option name
        raise EngineUnavailable(f"{spec.name}: bad derive options {derive.options}: {exc}") from None
    manifest = json.loads((target / MANIFEST).read_text())
    (target / MANIFEST).write_text(json.dumps({**manifest, "name": spec.name, "derive": wanted}, indent=2))
    log(f"{spec.name}: ready at {target}")
    return target
