"""The one config file (YAML, validated at start-up) and environment settings.

Environment (pydantic-settings, prefix ``CHORUS_``): ``CHORUS_HOME`` (cache directory),
``CHORUS_CONFIG`` (config file), ``CHORUS_HOST`` and ``CHORUS_PORT`` (override the file).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from engines.spec import ModelSpec

DEFAULT_CONFIG = "default_config.yaml"


class Limits(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(default=4 * 2**20, ge=1024)
    max_n: int = Field(default=16, ge=1)
    max_tokens: int | None = Field(default=None, ge=1, description="cap on max_tokens per request")


class ServerSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    limits: Limits = Field(default_factory=Limits)


class ChorusConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    server: ServerSection = Field(default_factory=ServerSection)
    models: list[ModelSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_names(self) -> ChorusConfig:
        names = [m.name for m in self.models]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"model names must be unique; repeated: {', '.join(dupes)}")
        return self

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


class ConfigError(Exception):
    pass


def load_config(path: str | Path | None = None) -> ChorusConfig:
    """Load and validate a config file; ``None`` means ``$CHORUS_CONFIG`` or the packaged default."""
    path = path or Settings().config
    if path is None:
        text = resources.files("server").joinpath(DEFAULT_CONFIG).read_text()
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
