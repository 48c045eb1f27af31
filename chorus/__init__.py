"""chorus: an OpenAI-compatible LLM inference gateway with ensemble and routing backends.

The distribution is ``chorus-gateway``; the one import package is ``chorus``. The repository keeps
one folder per layer and installs it under this package (``server/`` -> ``chorus.server`` ...):

    chorus.cli       the ``chorus`` command: one table of lazily imported subcommands
    chorus.bench     in-process benchmarks and tools (engine, ensembles, families, route calibration)
    chorus.server    HTTP only: app, OpenAI protocol, routes, auth, limits, metrics, session API
    chorus.config    the application's one config file (models, ensembles, workers, keys, limits)
    chorus.ensembles strategies over engines
    chorus.engines   where tokens come from (batching engine, remote workers, fake engine)
    chorus.engines.families   model families (MoE, MoDr, grafting) and the KV cache they share
    chorus.errors    the one exception tree (every error the server can return)
    chorus.clients   HTTP clients only (eval, load and gateway benches); imports nothing else of chorus

An import never goes up this list (import-linter contracts in pyproject.toml, checked in CI).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("chorus-gateway")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
