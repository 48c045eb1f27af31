"""The one config file (YAML, validated at start-up) and environment settings.

Environment (pydantic-settings, prefix ``CHORUS_``): ``CHORUS_HOME`` (cache directory),
``CHORUS_CONFIG`` (config file), ``CHORUS_HOST`` and ``CHORUS_PORT`` (override the file),
``CHORUS_API_KEYS`` (extra keys, ``name:key,...``; hashed at start-up).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from chorus.engines.core.spec import ModelSpec
from chorus.ensembles.base import register, strategy_class
from chorus.ensembles.spec import NamedEnsemble
from chorus.errors import ConfigError, GatewayError

DEFAULT_CONFIG = "default_config.yaml"


class Limits(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(default=4 * 2**20, ge=1024)
    max_n: int = Field(default=16, ge=1)
    max_tokens: int | None = Field(default=None, ge=1, description="cap on max_tokens per request")
    max_messages: int = Field(default=512, ge=1, description="messages per chat request")
    max_choices: int = Field(default=32, ge=1, description="choices per /v1/choices request")
    max_members: int = Field(default=16, ge=2, description="members per ensemble")
    max_rounds: int = Field(default=10, ge=0, description="exchange_of_thought rounds")
    max_candidates: int = Field(default=64, ge=1, description="candidates per ensemble request (crowd_vote: given or sampled; answer_vote, consistency_select: samples)")
    max_concurrent_requests: int = Field(default=256, ge=1, description="admission: more in flight -> 503 (under "
                                         "contention each key gets a fair share of them: 429 past it)")
    body_timeout_s: float = Field(default=30.0, gt=0, description="a request body must arrive within this long "
                                  "(408 after); it counts in flight only once read")
    max_stored_responses: int = Field(default=1000, ge=0, description="/v1/responses kept in memory (oldest "
                                      "dropped first) for GET and previous_response_id")
    max_embedding_inputs: int = Field(default=256, ge=1, description="inputs per /v1/embeddings request")
    request_timeout_s: float = Field(
        default=600.0, gt=0, description="deadline per request (X-Chorus-Timeout lowers it)"
    )


class LogSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    json_format: bool = Field(default=True, alias="json", description="one JSON object per line")
    level: str = "info"
    prompts: bool = Field(default=False, description="log prompt text (off: only sizes)")


class SessionsSection(BaseModel):
    """Token-level sessions over HTTP (``/chorus/v1/sessions``, server/api/extensions/sessions.py)."""

    model_config = ConfigDict(extra="forbid")

    idle_timeout_s: float = Field(default=60.0, gt=0, description="a session idle this long is freed")
    max_open: int = Field(default=256, ge=1, description="open sessions at most (429 beyond)")
    max_per_key: int | None = Field(default=None, ge=1, description="sessions one key may hold on one model (default: "
                                    "half its batch slots; all keys together: all slots but one, always)")


class PrefixCacheSection(BaseModel):
    """Who may reuse a prefix another request stored in an engine's prefix cache (server/gateway/tenancy.py). A hit is
    visible to the caller (``cached_tokens``, a fast first token), so a shared prefix tells one tenant what
    another's prompt starts with: by default a prefix is reused only by requests of the key that stored it."""

    model_config = ConfigDict(extra="forbid")

    #: ``key``: only the same key; ``team``: every key of the same ``team`` (a key without one: only itself);
    #: ``all``: every caller (one key can then test, token by token, what another key's prompts start with)
    share: Literal["key", "team", "all"] = "key"


class StateSection(BaseModel):
    """Where per-key windows, in-flight counts, budgets and spend live (server/gateway/key_state.py): ``memory`` (this
    process; the embedded default) or a Redis URL shared by every replica (server/gateway/redis_state.py)."""

    model_config = ConfigDict(extra="forbid")

    store: str = Field(default="memory", description='"memory" or "redis://HOST:PORT/DB" (rediss:// for TLS)')
    #: when Redis cannot be reached: serve and count locally (``fail_open``), or refuse with 503 (``fail_closed``)
    on_failure: Literal["fail_open", "fail_closed"] = "fail_open"
    key_prefix: str = Field(default="chorus", pattern=r"^[A-Za-z0-9:_-]+$", description="prefix of every Redis key")
    timeout_s: float = Field(default=0.5, gt=0, description="one Redis call; longer counts as an outage")
    reservation_ttl_s: float = Field(default=3600.0, ge=1, description="a request's worst case held in Redis expires "
                                     "after this long if its replica never settles it (it died)")
    admin_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$",
                                     description="the admin key's SHA-256: GET /admin/keys/{name} (off when unset)")

    @field_validator("store")
    @classmethod
    def _store(cls, v: str) -> str:
        if v != "memory" and not v.startswith(("redis://", "rediss://")):
            raise ValueError('store must be "memory" or a redis:// URL')
        return v


class Price(BaseModel):
    """A model's price per million tokens, in the currency a key's ``max_budget`` is given in."""

    model_config = ConfigDict(extra="forbid")

    prompt: float = Field(ge=0)
    completion: float = Field(ge=0)


class FeedbackMetric(BaseModel):
    """A metric ``POST /v1/feedback`` accepts: a boolean (thumbs up, test passed) or a number (a rating, a grade)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    type: Literal["boolean", "number"] = "boolean"
    higher_is_better: bool = True
    min: float | None = Field(default=None, description="number: the lowest value accepted (and scaled to 0)")
    max: float | None = Field(default=None, description="number: the highest value accepted (and scaled to 1)")

    @model_validator(mode="after")
    def _range(self) -> FeedbackMetric:
        if self.type == "boolean" and (self.min is not None or self.max is not None):
            raise ValueError(f"metric {self.name!r}: min and max apply to number metrics only")
        if self.min is not None and self.max is not None and not self.min < self.max:
            raise ValueError(f"metric {self.name!r}: min must be below max")
        return self

    def quality(self, value: float) -> float:
        """The value as a reward: a boolean 1 or 0; a number scaled to 0-1 by min and max when both are given;
        reversed when lower is better."""
        q = float(value)
        if self.type == "number" and self.min is not None and self.max is not None:
            q = (q - self.min) / (self.max - self.min)
            return q if self.higher_is_better else 1.0 - q
        return q if self.higher_is_better else (1.0 - q if self.type == "boolean" else -q)


class FeedbackSection(BaseModel):
    """``POST /v1/feedback`` (server/api/extensions/feedback.py): the metrics it accepts and how long a request is kept for it
    (in the state store: Redis when configured, so any replica joins feedback to any replica's requests)."""

    model_config = ConfigDict(extra="forbid")

    metrics: list[FeedbackMetric] = Field(default_factory=list)
    keep_s: float = Field(default=86_400.0, gt=0, description="a request can get feedback this long after it")
    max_requests: int = Field(default=100_000, ge=1, description="requests kept in this process (memory store)")
    max_events: int = Field(default=100_000, ge=1, description="learned outcomes kept per online router")
    max_buffered: int = Field(default=100_000, ge=1, description="records held in memory while the state store "
                              "is down, written when it is back (the oldest beyond this are lost, and counted)")

    @field_validator("metrics")
    @classmethod
    def _unique(cls, v: list[FeedbackMetric]) -> list[FeedbackMetric]:
        names = [m.name for m in v]
        if len(set(names)) != len(names):
            raise ValueError(f"metric names must be unique: {', '.join(names)}")
        return v


class BatchesSection(BaseModel):
    """OpenAI's Batch API (``/v1/files``, ``/v1/batches``; server/batch/): uploaded files under ``dir``, jobs and
    their lines in SQLite beside them; lines run in the background through the same routes as live requests."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    dir: str | None = Field(default=None, description="where files and the job database live (default: "
                            "$CHORUS_HOME/batches)")
    #: lines of all batches in flight at once in this process: the share of the engines' slots batch work may take
    concurrency: int = Field(default=4, ge=1, le=1024)
    max_file_bytes: int = Field(default=200 * 2**20, ge=1024, description="largest upload (OpenAI: 200 MB)")
    max_bytes_per_key: int = Field(default=2**30, ge=1024, description="a key's files together (uploads and its "
                                   "batches' outputs) at most this many bytes: an upload past it is a 413")
    max_lines: int = Field(default=50_000, ge=1, description="requests per batch (OpenAI: 50,000)")
    max_completion_window_s: float = Field(default=7 * 86_400.0, gt=0, description="longest completion_window")
    #: a line claimed by a process that stops answering is claimed again after this long (its answer not kept)
    lease_s: float = Field(default=900.0, gt=0)
    poll_s: float = Field(default=0.5, gt=0, description="how often the runner looks for work")


class ServerSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    limits: Limits = Field(default_factory=Limits)
    log: LogSection = Field(default_factory=LogSection)
    shutdown_grace_s: float = Field(default=30.0, ge=0, description="SIGTERM: in-flight requests get this long")
    sessions: SessionsSection = Field(default_factory=SessionsSection)
    state: StateSection = Field(default_factory=StateSection)
    feedback: FeedbackSection = Field(default_factory=FeedbackSection)
    prefix_cache: PrefixCacheSection = Field(default_factory=PrefixCacheSection)
    batches: BatchesSection = Field(default_factory=BatchesSection)
    #: the playground page at /playground (static files calling this server's API from the browser)
    playground: bool = True
    #: FastAPI's native OpenTelemetry (tracing, metrics, logs through the global OTel providers). Off by
    #: default: chorus exports Prometheus metrics itself, and the per-request check costs ~2% of a request.
    opentelemetry: bool = False


class ApiKey(BaseModel):
    """One API key, stored as its SHA-256 (`chorus keys hash` prints it); the raw key is never kept."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    models: list[str] | None = Field(default=None, description="models and ensembles it may use (default: all)")
    inline_ensembles: bool = Field(default=True, description="may compose ensembles in a request body (over the "
                                   "models it may use; false: only the models and named ensembles it may use)")
    team: str | None = Field(default=None, min_length=1, description="keys of one team share prefix caches "
                             "under server.prefix_cache.share: team")
    rpm: int | None = Field(default=None, ge=1, description="requests per minute")
    tpm: int | None = Field(default=None, ge=1, description="tokens (prompt + completion) per minute")
    max_concurrent: int | None = Field(default=None, ge=1, description="requests in flight at once")
    max_budget: float | None = Field(default=None, gt=0, description="spend allowed per budget period (429 above)")
    budget_unit: Literal["tokens", "currency"] = Field(
        default="tokens", description="tokens, or currency through the config's per-model prices")
    budget_period_s: int | None = Field(default=None, ge=60, description="the budget resets this long after the "
                                        "period's first charge (none: never)")


class AuthSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keys: list[ApiKey] = Field(default_factory=list)


class ChorusConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    server: ServerSection = Field(default_factory=ServerSection)
    models: list[ModelSpec] = Field(min_length=1)
    auth: AuthSection = Field(default_factory=AuthSection)
    strategies: dict[str, str] = Field(
        default_factory=dict, description='third-party strategies: name -> "module:Class"'
    )
    ensembles: list[NamedEnsemble] = Field(default_factory=list, description="named ensembles, served as models")
    prices: dict[str, Price] = Field(default_factory=dict, description="model -> price per million tokens")

    @model_validator(mode="after")
    def _unique_names(self) -> ChorusConfig:
        names = [m.name for m in self.models] + [e.name for e in self.ensembles]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"model and ensemble names must be unique; repeated: {', '.join(dupes)}")
        return self

    @model_validator(mode="after")
    def _keys(self) -> ChorusConfig:
        served = {m.name for m in self.models} | {e.name for e in self.ensembles}
        for key in self.auth.keys:
            unknown = sorted(set(key.models or ()) - served)
            if unknown:
                raise ValueError(f"API key {key.name!r} allows unknown models: {', '.join(unknown)}")
        names = [k.name for k in self.auth.keys]
        if len(set(names)) != len(names):
            raise ValueError("API key names must be unique")
        unknown = sorted(set(self.prices) - {m.name for m in self.models})
        if unknown:
            raise ValueError(f"prices for unknown models: {', '.join(unknown)} (prices are per model; an ensemble "
                             "costs what its member calls cost)")
        currency = any(k.max_budget is not None and k.budget_unit == "currency" for k in self.auth.keys)
        if self.prices or currency:  # a model without a price would be free: every member and judge priced
            unpriced = sorted({m.name for m in self.models} - set(self.prices))
            if unpriced:
                why = "a budget in currency needs" if currency else "with prices set, chorus needs"
                raise ValueError(f"{why} a price for every model (an unpriced one would cost nothing); no price "
                                 f"for: {', '.join(unpriced)}")
        return self

    @model_validator(mode="after")
    def _ensembles(self) -> ChorusConfig:
        for name, target in self.strategies.items():
            register(name, target)
        models = {m.name for m in self.models}
        for e in self.ensembles:
            missing = sorted({m.model for m in e.members if m.model not in models})
            if missing:
                raise ValueError(f"ensemble {e.name!r}: unknown member model(s) {', '.join(missing)}")
            try:
                klass = strategy_class(e.strategy)
                params = klass.Params.model_validate(e.params)
                klass.check_config(params, [m.model for m in e.members])
                klass.check_links(params, e.name, {x.name for x in self.ensembles},
                                  {m.name for m in self.server.feedback.metrics})
            except GatewayError as exc:
                raise ValueError(f"ensemble {e.name!r}: {exc.message}") from None
            except ValidationError as exc:
                raise ValueError(f"ensemble {e.name!r}: invalid parameters for {e.strategy}: {exc}") from None
            except ImportError as exc:
                raise ValueError(f"ensemble {e.name!r}: cannot import strategy {e.strategy!r}: {exc}") from None
        return self

    def served(self, not_ready: Callable[[ModelSpec], str | None]) -> tuple[ChorusConfig, list[str]]:
        """The config ``chorus serve`` serves, and one line per thing it leaves out: an optional model that is
        not ready (``not_ready`` says why: not prepared, its engine's library missing), and a named ensemble with a member left out. Everything else is kept, so a
        non-optional model that cannot be prepared still fails where it is prepared."""
        skipped: list[str] = []
        models = []
        for m in self.models:
            why = not_ready(m) if m.optional else None
            if why:
                how = m.add_with or f"chorus models prepare {m.name}"
                skipped.append(f"{m.name}: optional and {why}, not served (add it with: {how})")
            else:
                models.append(m)
        names = {m.name for m in models}
        ensembles = []
        for e in self.ensembles:
            missing = sorted({m.model for m in e.members} - names)
            if missing:
                skipped.append(f"{e.name}: not served, its member {', '.join(missing)} is not served")
            else:
                ensembles.append(e)
        # no revalidation: a key may still name a model left out (it is simply not served)
        return self.model_copy(update={"models": models, "ensembles": ensembles}), skipped

    def model(self, name: str) -> ModelSpec:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CHORUS_")

    home: Path | None = None
    config: Path | None = None
    host: str | None = None
    port: int | None = None
    #: extra API keys, comma separated, each ``name:key`` or ``key``; hashed at start-up, no per-key limits
    api_keys: str | None = None
    #: the admin key itself (``GET /admin/keys/{name}``), hashed at start-up; for a Secret in the environment
    #: instead of ``server.state.admin_sha256`` in the config (either one turns the admin API on)
    admin_key: str | None = None
    #: where the Batch API keeps its files and jobs when the config's ``server.batches.dir`` does not say
    #: (default ``$CHORUS_HOME/batches``)
    batch_dir: Path | None = None


def load_config(path: str | Path | None = None) -> ChorusConfig:
    """Load and validate a config file; ``None`` means ``$CHORUS_CONFIG`` or the packaged default."""
    path = path or Settings().config
    if path is None:
        text = resources.files("chorus").joinpath(DEFAULT_CONFIG).read_text()
        where = f"packaged {DEFAULT_CONFIG}"
    else:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from exc
        where = str(path)
    try:
        return ChorusConfig.model_validate(yaml.safe_load(text) or {})
    except (yaml.YAMLError, ValidationError) as exc:
        raise ConfigError(f"invalid config {where}:\n{exc}") from exc
