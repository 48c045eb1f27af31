"""The options of ``engine: remote``: replicas of one model on OpenAI-compatible servers, and how to talk to them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class RemoteOptions(BaseModel):
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
    #: send the request's prefix scope (tenant and client salt) as ``cache_salt``: vLLM (>= 0.9) and chorus
    #: workers keep prefixes of different salts apart; turn it off only for a server that refuses the field
    cache_salt: bool = True
