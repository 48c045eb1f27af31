"""The options of ``engine: remote``: replicas of one model on OpenAI-compatible servers, and how to talk to them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class AffinityOptions(BaseModel):
    """How ``routing: prefix`` and ``routing: session`` place requests (routing.py)."""

    model_config = ConfigDict(extra="forbid")

    block_tokens: int = Field(default=32, ge=1, le=4096, description="prompt tokens per hashed block")
    min_match_tokens: int = Field(default=64, ge=1, description="a cached run shorter than this is no reason to go")
    index_blocks: int = Field(default=100_000, ge=1, description="block hashes remembered per replica (LRU)")
    virtual_nodes: int = Field(default=64, ge=1, le=1024, description="points per replica on the hash ring")
    #: a prompt no replica holds a run of: to the least busy replica, or placed on the hash ring by its opening
    cold: Literal["least_outstanding", "ring"] = "least_outstanding"
    load_factor: float = Field(default=1.25, ge=1.0, description="a replica over this x the mean load is passed over")
    spill_after: int = Field(default=2, ge=1, description="a replica with fewer requests in flight is never passed "
                             "over for load")


class RemoteOptions(BaseModel):
    """Replicas of one model on OpenAI-compatible servers, and how to talk to them."""

    model_config = ConfigDict(extra="forbid")

    replicas: list[str] = Field(min_length=1, description="base URLs, e.g. http://gpu-1:8000/v1")
    model: str | None = Field(default=None, description="the model's name on the servers (default: this name)")
    #: the model's tokenizer: a directory, the name of a model in this config (its prepared checkpoint), or a hub
    #: repository (``hf:ORG/REPO``, its tokenizer files; the entry's ``revision`` pins it)
    tokenizer: str = Field(description="tokenizer directory, configured model name, or hf:ORG/REPO")
    api: Literal["completions", "chat"] = Field(
        default="completions", description="completions: prompt as token ids (vLLM, chorus worker); chat: messages")
    api_key_env: str | None = Field(default=None, description="environment variable with the servers' API key")
    connect_timeout_s: float = Field(default=5.0, gt=0)
    read_timeout_s: float = Field(default=120.0, gt=0, description="longest silence while waiting for bytes")
    cooldown_s: float = Field(default=10.0, ge=0, description="a failing replica is out for this long")
    health_interval_s: float = Field(default=5.0, gt=0)
    #: read each healthy replica's /metrics this often for its requests waiting and running (the model-server
    #: protocol's gauges, vLLM's names): a replica busy with other gateways' or clients' requests counts as busy.
    #: 0: never (the pool then knows only its own requests in flight)
    load_interval_s: float = Field(default=1.0, ge=0)
    max_connections: int = Field(default=256, ge=1)
    top_logprobs: int = Field(
        default=20, ge=1, le=20, description="logit averaging over remote members: top-k per step"
    )
    #: token-level sessions for logit averaging: ``completions`` = top-k logprobs over /v1/completions
    #: (any OpenAI server, approximate); ``chorus`` = a chorus worker's /chorus/v1/sessions (exact logits)
    token_api: Literal["completions", "chorus"] = "completions"
    #: the servers take chorus's model-family request fields (MoDr's ``recurrence`` / ``exit``, ReasonFormer's
    #: ``max_steps`` / ``stop_threshold``) and check them: chorus workers do. vLLM does not, even serving a family
    #: through chorus's plugin (it would ignore them), so by default a request that sets one is refused with 400
    family_options: bool = False
    #: send the request's prefix scope (tenant and client salt) as ``cache_salt``: vLLM (>= 0.9) and chorus
    #: workers keep prefixes of different salts apart; turn it off only for a server that refuses the field
    cache_salt: bool = True
    #: batch work (Batch API lines) is sent with this ``priority`` so the servers can run it behind live requests:
    #: chorus workers queue any priority > 0 as batch work; vLLM needs ``--scheduling-policy priority`` (lower runs
    #: first; live requests go with 0). None: not sent (a server that refuses the field)
    batch_priority: int | None = Field(default=None, ge=1)
    #: which replica answers (routing.py): the fewest requests in flight (``least_outstanding``), the one most likely
    #: to hold the prompt's prefix in its cache (``prefix``), or one per conversation (``session``). The default
    #: stays least_outstanding: prefix was not measured better here (docs/benchmarks.md, chorus bench cluster)
    routing: Literal["least_outstanding", "prefix", "session"] = "least_outstanding"
    affinity: AffinityOptions = Field(default_factory=AffinityOptions)
