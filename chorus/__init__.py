"""chorus: an OpenAI-compatible LLM inference gateway with ensemble and routing backends.

The distribution is ``chorus-gateway``; the one import package is ``chorus``, and its folders are its layers (an
import path is a file path), top to bottom:

    chorus.cli        the ``chorus`` command: one table of lazily imported subcommands
    chorus.bench      in-process benchmarks and tools (engine, llama, ensembles, families, answers, ...)
    chorus.server     HTTP only: the app, the APIs' request and reply shapes, routes, the one step that
                      resolves a request's model for its key, auth, limits, metrics, the session API
    chorus.config     the application's one config file (models, ensembles, workers, keys, limits)
    chorus.training   training loops and fits (MoE, MoDr, ReasonFormer, DUMA, selectors, cascades)
    chorus.clients    HTTP clients (eval, load and gateway benches); of chorus only ``ensembles.answers``
    chorus.ensembles  strategies over engines, routers, answer types and extraction
    chorus.engines    where tokens come from: one sub-package per engine kind over ``engines.core``, then the
                      model families and the run-time parts they share
    chorus.errors     the one exception tree (every error the server can return)

An import never goes up this list (import-linter contracts in pyproject.toml, checked in CI).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("chorus-gateway")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
