"""Reading a dense Llama-architecture checkpoint and writing derived ones, atomically.

Every family builder (upcycle, graft, MoDr retrofit) reads its base through `load_base` and
writes through `atomic_output`: the new checkpoint is built in a temporary directory beside the
target and renamed into place only when complete, so a failed or interrupted build leaves no
partial output directory behind. Bad input raises `BuildError` before any work is done.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

from chorus.errors import BuildError

#: architectures the builders accept as a base: the Llama layer layout (q/k/v/o, gate/up/down, RMSNorm)
LLAMA_TYPES = ("llama", "mistral")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "chat_template.jinja", "generation_config.json")
MANIFEST = "chorus-prepared.json"


@dataclass
class Base:
    """A dense base checkpoint: its directory, config (as a dict) and tensors by name."""

    path: Path
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    @property
    def n_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        """Layer ``i``'s tensors keyed by their name inside the layer (``self_attn.q_proj.weight``)."""
        prefix = f"model.layers.{i}."
        return {k[len(prefix):]: v for k, v in self.tensors.items() if k.startswith(prefix)}

    def outside_layers(self) -> dict[str, torch.Tensor]:
        """Embeddings, final norm, head: everything that is not in a decoder layer."""
        return {k: v for k, v in self.tensors.items() if not k.startswith("model.layers.")}


def read_config(path: Path) -> dict[str, Any]:
    path = Path(path).expanduser()
    if not path.is_dir():
        raise BuildError(f"{path} is not a directory (give a Hugging Face checkpoint directory)")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise BuildError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    try:
        return json.loads(cfg_file.read_text())
    except ValueError as exc:
        raise BuildError(f"{cfg_file} is not valid JSON: {exc}") from None


def check_llama(config: dict[str, Any], path: Path, what: str) -> None:
    kind = config.get("model_type")
    if kind not in LLAMA_TYPES:
        raise BuildError(f"{what} needs a Llama-architecture checkpoint ({', '.join(LLAMA_TYPES)}); "
                         f"{path} is model_type {kind!r}")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise BuildError(f"{what}: {path} uses attention/MLP biases, which the derived formats do not carry")


def load_base(path: Path | str, what: str) -> Base:
    """Read a Llama-architecture checkpoint (config + every ``*.safetensors`` shard), or raise BuildError."""
    from safetensors.torch import load_file

    path = Path(path).expanduser()
    config = read_config(path)
    check_llama(config, path, what)
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise BuildError(f"{path} has no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors.update(load_file(shard))
    n = int(config["num_hidden_layers"])
    for i in (0, n - 1):
        if f"model.layers.{i}.self_attn.q_proj.weight" not in tensors:
            raise BuildError(f"{path}: weights for layer {i} are missing (config says {n} layers)")
    return Base(path, config, tensors)


def check_new_dir(out: Path | str, force: bool = False) -> Path:
    out = Path(out).expanduser()
    if out.exists() and not force and (not out.is_dir() or any(out.iterdir())):
        raise BuildError(f"{out} already exists and is not empty (pass --force to replace it)")
    return out


@contextmanager
def atomic_output(out: Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary directory; on success it replaces ``out``, on any error it is removed."""
    out = check_new_dir(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def save_checkpoint(out: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor],
                    manifest: dict[str, Any]) -> None:
    """config.json + model.safetensors (+ a manifest listing the files, as prepared models have)."""
    from safetensors.torch import save_file

    if config.get("tie_word_embeddings"):
        tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    # every tensor gets its own storage: safetensors refuses shared memory
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    write_manifest(out, manifest)


def model_type_of(path: Path | str) -> str | None:
    """The ``model_type`` in a directory's config.json (None when there is none or it is not JSON)."""
    try:
        return json.loads((Path(path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def frozen_spans(base: Any, *ranges: tuple[int, int]) -> list[Any]:
    """Freeze a transformers decoder's parameters and return its layers over each half-open range, as
    `torch.nn.ModuleList`s (MoDr's prelude / core / coda, ReasonFormer's representation / block / coda)."""
    for p in base.parameters():
        p.requires_grad_(False)
    return [torch.nn.ModuleList(base.model.layers[a:b]) for a, b in ranges]


def load_llama_model(path: Path | str, what: str, dtype: torch.dtype = torch.float32) -> Any:
    """A Llama-architecture checkpoint as a transformers model (eval mode, sdpa attention), for the families
    built over a frozen base (MoDr, ReasonFormer); ``what`` names the family in the error."""
    from transformers import AutoModelForCausalLM

    path = Path(path).expanduser()
    check_llama(read_config(path), path, what)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()


def save_over_base(out: Path, *, family: str, model_type: str, cfg: dict[str, Any], base_config: Any,
                   tensors: dict[str, torch.Tensor], weights: str, extra: dict[str, Any] | None = None) -> None:
    """A checkpoint of trained pieces over a frozen base (MoDr, ReasonFormer) into ``out`` (an existing empty
    directory): ``weights`` (safetensors), ``config.json`` (``model_type``, the family's settings under
    ``family``, the base reference), the base's tokenizer files and the manifest."""
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, str(out / weights),
              metadata={"format": "pt"})
    base = Path(cfg["base"])
    config = {"model_type": model_type, family: cfg, "base": str(base), "base_model_type": base_config.model_type,
              "hidden_size": base_config.hidden_size, "vocab_size": base_config.vocab_size, **(extra or {})}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if base.is_dir():
        copy_tokenizer(base, out)
    write_manifest(out, {"family": family, "base": str(base)})


def load_over_base(path: Path | str, *, model_type: str, what: str,
                   dtype: torch.dtype = torch.float32) -> tuple[dict[str, Any], Path, Any]:
    """The parts of a `save_over_base` checkpoint: its config.json, the base directory and the base model
    (``what`` names the family in errors)."""
    path = Path(path).expanduser()
    config = read_config(path)
    if config.get("model_type") != model_type:
        raise BuildError(f"{path} is not a {what} checkpoint (model_type {config.get('model_type')!r})")
    base_dir = Path(config["base"])
    if not base_dir.is_absolute():
        base_dir = (path / base_dir).resolve()
    if not (base_dir / "config.json").is_file():
        raise BuildError(f"{path}: its base checkpoint {base_dir} is missing")
    base = load_llama_model(base_dir, what, dtype)
    if base.config.hidden_size != config.get("hidden_size", base.config.hidden_size):
        raise BuildError(f"{path}: base {base_dir} has hidden size {base.config.hidden_size}, "
                         f"the {what} weights were built for {config['hidden_size']}")
    return config, base_dir, base


def write_manifest(out: Path, manifest: dict[str, Any]) -> None:
    """The manifest prepared models have: ``manifest`` plus the files beside it and their sizes."""
    files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file() and p.name != MANIFEST}
    (out / MANIFEST).write_text(json.dumps({**manifest, "files": files}, indent=2))


def tiny_llama(out: Path, *, layers: int = 4, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
               intermediate: int = 128, vocab: int = 256, seed: int = 0, tokenizer_from: Path | None = None) -> Path:
    """A random tiny Llama checkpoint (the tests' preset base for every family builder)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(out)
    if tokenizer_from is not None:
        copy_tokenizer(tokenizer_from, out)
    return out


@dataclass(frozen=True)
class OverBase:
    """A family stored as its own weights beside a reference to a dense Llama-architecture base (MoDr,
    ReasonFormer): what the two share, once. ``config`` has ``from_json``, ``from_options(n_layers, options)``,
    ``check(n_layers)`` and ``to_json``; ``model`` is built as ``model(base, cfg)`` and has ``state_tensors`` /
    ``load_state_tensors``; ``describe(cfg)`` says what a retrofit built."""

    family: str  #: the key of its settings in config.json ("modr")
    model_type: str  #: config.json's model_type ("chorus_modr")
    what: str  #: its name in messages ("MoDr")
    weights: str  #: the safetensors file of its own weights
    config: Any
    model: Any
    describe: Any

    def load_base_model(self, path: Path | str, dtype: torch.dtype = torch.float32) -> Any:
        return load_llama_model(path, self.what, dtype)

    def is_dir(self, path: Path | str) -> bool:
        return model_type_of(path) == self.model_type

    def save(self, model: Any, out: Path, *, extra: dict[str, Any] | None = None) -> None:
        """Write config + the family's weights into ``out`` (an existing empty directory) and the tokenizer files."""
        save_over_base(out, family=self.family, model_type=self.model_type, cfg=model.cfg.to_json(),
                       base_config=model.config, tensors=model.state_tensors(), weights=self.weights,
                       extra={"architectures": [self.model.__name__], **(extra or {})})

    def load(self, path: Path | str, dtype: torch.dtype = torch.float32, **overrides: Any) -> Any:
        """For serving: every parameter frozen (training turns its own back on); ``overrides`` replace the
        checkpoint's settings."""
        from safetensors.torch import load_file

        config, base_dir, base = load_over_base(path, model_type=self.model_type, what=self.what, dtype=dtype)
        cfg = self.config.from_json({**config[self.family], **overrides})
        cfg.base = str(base_dir)
        model = self.model(base, cfg)
        model.load_state_tensors(load_file(Path(path).expanduser() / self.weights))
        for p in model.parameters():
            p.requires_grad_(False)
        return model.to(dtype).eval()

    def retrofit(self, base_dir: Path | str, out: Path | str, options: dict[str, Any] | None = None, *,
                 force: bool = False, seed: int = 0, log: Any = print) -> Path:
        """A fresh checkpoint of the family over a Llama-architecture base, its own parts untrained; ``options``
        as the config's ``from_options`` takes them."""
        import time

        base_dir = Path(base_dir).expanduser().resolve()
        out = check_new_dir(out, force)
        config = read_config(base_dir)
        check_llama(config, base_dir, f"{self.what} retrofit")
        n = int(config["num_hidden_layers"])
        cfg = self.config.from_options(n, options or {})
        cfg.base = str(base_dir)
        cfg.check(n)
        t0 = time.perf_counter()
        torch.manual_seed(seed)
        model = self.model(self.load_base_model(base_dir), cfg)
        with atomic_output(out, force) as tmp:
            self.save(model, tmp, extra={"seconds": round(time.perf_counter() - t0, 1)})
        log(f"retrofitted {base_dir.name} into {self.what} ({self.describe(cfg)}) at {out}")
        return out


class SpansConfig(Protocol):
    def check(self, n_layers: int) -> None: ...


class OverBaseModel(torch.nn.Module):
    """The common start of a model over a frozen base: the config checked against the base's depth and the base
    kept (its embeddings, norm, head, rotary); the model then cuts its frozen layers into spans (`frozen_spans`)."""

    base: Any  # the transformers model the layers come from
    config: Any  # the base's transformers config
    family: ClassVar[str]  #: its name in errors ("MoDr", "ReasonFormer")

    def __init__(self, base: Any, cfg: SpansConfig) -> None:
        super().__init__()
        cfg.check(base.config.num_hidden_layers)
        self.config = base.config
        self.base = base

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """What its checkpoint stores (its own weights; never the base's)."""
        raise NotImplementedError

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Its weights from a checkpoint's tensors, every one present with its shape."""
        want = self.state_tensors()
        missing = sorted(set(want) - set(tensors))
        if missing:
            raise BuildError(f"{self.family} weights are missing {missing[:4]}")
        with torch.no_grad():
            for k, t in want.items():
                if t.shape != tensors[k].shape:
                    raise BuildError(f"{self.family} weight {k} has shape {tuple(tensors[k].shape)}, "
                                     f"expected {tuple(t.shape)}")
                t.copy_(tensors[k])
