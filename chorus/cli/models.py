"""``chorus models prepare`` and ``chorus models list``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from chorus.cli.serve import config_of


def prepare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("names", nargs="*", help="models to prepare (default: every model not marked optional)")
    p.add_argument("--force", action="store_true", help="rebuild even when prepared")


def prepare(args: argparse.Namespace) -> int:
    from chorus.engines.prepare import prepare_model
    from chorus.errors import GatewayError

    config = config_of(args)
    names = args.names or [m.name for m in config.models if not m.optional]
    known = {m.name for m in config.models}
    unknown = [n for n in names if n not in known]
    if unknown:
        sys.exit(f"chorus: unknown model(s) {', '.join(unknown)}; the config has: {', '.join(sorted(known))}")
    failed = 0
    for name in names:
        try:
            prepare_model(config.model(name), force=args.force, models={m.name: m for m in config.models})
        except GatewayError as exc:
            print(f"{name}: FAILED: {exc.message}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


def list_models(args: argparse.Namespace) -> int:
    from chorus.engines.embedding import model_dir
    from chorus.engines.prepare import is_prepared, is_ready
    from chorus.engines.spec import chorus_home

    config = config_of(args)
    home = chorus_home()
    print(f"{'name':28} {'engine':12} {'device':7} {'state':12} location")
    for m in config.models:
        d = m.checkpoint_dir(home)
        if m.engine == "fake":
            state = "built-in"
        elif m.engine == "llama_cpp":  # the GGUF as it is: ready once llama-cpp-python is installed
            state = "ready" if is_ready(m) else "optional" if m.optional else "missing"
            d = Path(str(m.source or m.path))  # named, not resolved: a split GGUF would be joined to list it
        elif m.engine == "embedding":  # a sentence-transformers directory, or the package that carries one
            try:
                d = Path(model_dir(m))
                state = "ready" if d.is_dir() else "missing"
            except Exception:  # its package is not installed, or the source is not one chorus knows
                d, state = Path(str(m.source or m.path)), "missing"
        elif m.needs_prepare:
            state = "prepared" if is_prepared(d) else "optional" if m.optional else "not prepared"
        else:
            state = "local" if (d / "config.json").is_file() else "missing"
        print(f"{m.name:28} {m.engine:12} {m.device:7} {state:12} {d if m.engine != 'fake' else '-'}")
    return 0


