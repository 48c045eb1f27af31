"""`chorus route calibrate`: thresholds of a cost router for target shares of calls, from sample prompts.

The cost router sends a prompt to member i + 1 or beyond when its difficulty score (nearness to the
hard examples, minus nearness to the easy ones) is >= thresholds[i]. Given a sample of prompts like
your traffic, the threshold for "a share s of calls reaches member i + 1 or beyond" is the (1 - s)
quantile of the sample's scores. Prints the thresholds and the split they give on the sample.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def sample_prompts(path: Path, limit: int | None) -> list[str]:
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            out.append(str(item.get("prompt") or item["question"]))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise SystemExit(
                f"chorus route calibrate: {path}:{n}: need a JSON object with 'prompt' or 'question'"
            ) from None
        if limit is not None and len(out) >= limit:
            break
    return out


def calibrate(args: argparse.Namespace) -> str:
    from chorus.config import load_config
    from chorus.ensembles.routers.base import RouteParams
    from chorus.ensembles.routers.cost import CostParams, difficulty
    from chorus.ensembles.similarity import Embedder

    named = {e.name: e for e in load_config(args.config).ensembles}
    if args.ensemble in named:
        route = RouteParams.model_validate(named[args.ensemble].params)
        members = [m.name or m.model for m in named[args.ensemble].members]
    else:
        try:
            raw = json.loads(args.ensemble)
        except json.JSONDecodeError:
            raise SystemExit(f"chorus route calibrate: {args.ensemble!r} is neither a named ensemble "
                             f"({', '.join(named) or 'none'}) nor JSON") from None
        members = [m if isinstance(m, str) else m.get("name") or m["model"] for m in raw.pop("members", [])]
        raw.pop("strategy", None)
        raw.pop("trace", None)
        raw.setdefault("thresholds", None)
        route = RouteParams.model_validate(raw)
    params = route.router_params() if route.router == "cost" else None
    if not isinstance(params, CostParams) or not params.hard_examples:
        raise SystemExit("chorus route calibrate: needs a route ensemble with router: cost and hard_examples")
    shares = sorted(args.share, reverse=True)
    if len(members) and len(shares) != len(members) - 1:
        raise SystemExit(f"chorus route calibrate: give {len(members) - 1} --share value(s) for {len(members)} members "
                         "(share of calls that reach member 2, member 3, ...; decreasing)")
    prompts = sample_prompts(Path(args.prompts), args.limit)
    hard = Embedder.embed(params.hard_examples)
    easy = Embedder.embed(params.easy_examples) if params.easy_examples else None
    queries = Embedder.embed(prompts)
    scores = np.array([difficulty(q, hard, easy, params.k) for q in queries])
    thresholds = [float(np.quantile(scores, 1 - s)) for s in shares]
    picks = np.searchsorted(np.array(thresholds), scores, side="right")  # member index per prompt
    lines = [f"{len(prompts)} sample prompts from {args.prompts}; scores min {scores.min():.4f}, "
             f"median {np.median(scores):.4f}, max {scores.max():.4f}", "",
             "| member | target share reaching it | threshold | share of the sample it answers |",
             "|---|---|---|---|"]
    for i, name in enumerate(members or [f"member {i}" for i in range(len(shares) + 1)]):
        target = "-" if i == 0 else f"{shares[i - 1]:.2f}"
        thr = "-" if i == 0 else f"{thresholds[i - 1]:.4f}"
        lines.append(f"| {name} | {target} | {thr} | {float(np.mean(picks == i)):.2f} |")
    lines += ["", "thresholds: [" + ", ".join(f"{t:.4f}" for t in thresholds) + "]"]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    print(calibrate(args))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ensemble", required=True, help="a named route ensemble from the config, or its JSON")
    p.add_argument("--prompts", required=True, help="JSONL sample of traffic: 'prompt' or 'question' per line")
    p.add_argument("--share", type=float, action="append", required=True,
                   help="share of calls that should reach member 2 (then 3, ...); repeat for more members")
    p.add_argument("--limit", type=int, help="first N prompts")
