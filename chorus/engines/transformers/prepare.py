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
from typing import Any

from chorus.engines.core import hub
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
    files = _manifest(d).get("files", {})
    return bool(files) and all((d / n).is_file() and (d / n).stat().st_size == s for n, s in files.items())


def prepare_checkpoint(spec: ModelSpec, home: Path, *, force: bool = False, log: Callable[[str], None] = print,
                       models: dict[str, ModelSpec] | None = None) -> Path:
    """Convert ``spec`` into a servable checkpoint; ``models`` resolves a derived model's base by name."""
    if spec.derive is not None:
        return _prepare_derived(spec, home, force, log, models or {})
    if (repo := hub.repository(spec.source)) is not None:
        return _prepare_from_hub(spec, repo, home, force, log)
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
    _write_atomically(target, lambda tmp: _convert(spec, home, tmp, log))
    log(f"{spec.name}: ready at {target}")
    return target


def _write_atomically(target: Path, write: Callable[[Path], None]) -> None:
    """``write`` fills a temporary directory beside ``target``, renamed into its place only when done: an
    interrupted run never leaves a checkpoint that later loads."""
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)  # left by an interrupted run
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    try:
        write(tmp)
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _convert(spec: ModelSpec, home: Path, out: Path, log: Callable[[str], None]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    log(f"{spec.name}: [1/4] locating GGUF ({spec.source or spec.path})")
    gguf = resolve_gguf(spec, home, log)
    log(f"{spec.name}: [2/4] loading and dequantizing {gguf.name} ({gguf.stat().st_size / 2**20:.0f} MiB)")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF-loaded model counts as quantized and refuses save_pretrained: rebuild it from its config.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):  # no weights of its own: it takes the dequantized tensors (one float32 copy)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False, assign=True)
    missing = [k for k in missing if k not in getattr(model, "_tied_weights_keys", {})]
    if missing or unexpected:
        raise EngineUnavailable(
            f"{spec.name}: state dict mismatch (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    model.tie_weights()
    probe = tok(PROBE, return_tensors="pt")
    with torch.inference_mode():
        want = quantized(**probe).logits
    del quantized  # the model written holds the same tensors; the reloaded one comes after it is gone
    log(f"{spec.name}: [3/4] writing safetensors to {out}")
    out.mkdir(parents=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    del model
    log(f"{spec.name}: [4/4] verifying the written checkpoint")
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.inference_mode():
        got = reloaded(**probe).logits
    diff = float((want - got).abs().max())
    if diff > 1e-4:
        raise EngineUnavailable(f"{spec.name}: verification failed, reloaded logits differ by {diff:.2e}")
    manifest = {
        "name": spec.name, "source": spec.sources or spec.path, "gguf": str(gguf),
        "probe_max_abs_diff": diff, "seconds": round(time.perf_counter() - t0, 1), "files": _files(out),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))


def _prepare_from_hub(spec: ModelSpec, repo: hub.HubSource, home: Path, force: bool,
                      log: Callable[[str], None]) -> Path:
    """A checkpoint repository on the hub: fetched into huggingface_hub's cache (each LFS file hashed), and linked
    into ``$CHORUS_HOME/models/NAME`` (the bytes stay in the hub cache, once)."""
    target = spec.prepared_dir(home)
    wanted = {"source": spec.source, "revision": spec.revision}
    if not force and is_prepared(target) and {k: _manifest(target).get(k) for k in wanted} == wanted:
        log(f"{spec.name}: already prepared at {target}")
        return target
    folder = hub.fetch_snapshot(repo, spec.revision, hub.CHECKPOINT_FILES, log)
    files = sorted(p.relative_to(folder) for p in folder.rglob("*") if p.is_file())
    if not (folder / "config.json").is_file() or not any(f.suffix == ".safetensors" for f in files):
        raise EngineUnavailable(f"{spec.name}: {spec.source} is not a transformers checkpoint with safetensors "
                                f"weights (it has {', '.join(map(str, files[:8])) or 'none of'} ...); for a GGUF "
                                f"repository name the file: {spec.source}:Q4_K_M or {spec.source}/FILE.gguf")

    def link(tmp: Path) -> None:
        for f in files:
            (tmp / f).parent.mkdir(parents=True, exist_ok=True)
            (tmp / f).symlink_to(folder / f)
        manifest = {"name": spec.name, **wanted, "commit": folder.name, "snapshot": str(folder),
                    "files": _files(tmp)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))

    _write_atomically(target, link)
    log(f"{spec.name}: ready at {target} (commit {folder.name}, files in {folder})")
    return target


def _manifest(d: Path) -> dict[str, Any]:
    try:
        found: dict[str, Any] = json.loads((d / MANIFEST).read_text())
        return found
    except (OSError, ValueError):
        return {}


def _prepare_derived(spec: ModelSpec, home: Path, force: bool, log: Callable[[str], None],
                     models: dict[str, ModelSpec]) -> Path:
    """Build a derived checkpoint (MoE upcycle, graft, MoDr / ReasonFormer retrofit) from its base, preparing the
    base first."""
    from chorus.errors import BuildError

    derive = spec.derive
    assert derive is not None
    target = spec.prepared_dir(home)
    wanted = derive.model_dump()
    if not force and is_prepared(target) and _manifest(target).get("derive") == wanted:
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
    manifest = json.loads((target / MANIFEST).read_text())  # the builder wrote it
    (target / MANIFEST).write_text(json.dumps({**manifest, "name": spec.name, "derive": wanted}, indent=2))
    log(f"{spec.name}: ready at {target}")
    return target
