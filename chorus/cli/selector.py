"""``chorus train selector``: score labelled multiple-choice items with each member through a running chorus
(``/v1/choices``, cached as ``chorus eval --cache`` caches them, so members run once across trainings and
evaluations), fit the selector and the prompt-only router (chorus/training/selector.py) and write both
artifacts to ``$CHORUS_HOME/selectors/NAME`` (``selector.json`` for the ``select`` strategy, ``router.json`` for
``route`` with ``router: learned``). On generative items (prompt or question, and answer;
chorus/clients/eval_generative.py) only the router is fit: the ``select`` strategy reads per-choice scores."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np


def train_selector(args: argparse.Namespace) -> int:
    from chorus.bench.selector import prices
    from chorus.clients.eval_choices import member_answers, member_seconds
    from chorus.clients.eval_generative import is_generative
    from chorus.ensembles.fitted.artifact import artifact_path
    from chorus.training.selector import best_norms, correctness, data_hash, fit_selector

    if len(args.member) < 2:
        sys.exit("chorus train selector: give at least two --member models")
    data = Path(args.data)
    if is_generative(data):
        return train_router_only(args, data)
    items, answers = member_answers(args.url, data, args.member, Path(args.cache), offset=args.offset,
                                    limit=args.limit, concurrency=args.concurrency)
    gold = np.array([it.label for it in items])
    try:
        sel = fit_selector(args.member, answers, gold, [len(it.prompt) for it in items],
                           data_hash=f"{data_hash(data)}:{args.offset}:{args.limit}", folds=args.folds,
                           seed=args.seed)
        secs = prices(args.price, args.member) or member_seconds(Path(args.cache), data, args.member,
                                                                 [it.id for it in items])
    except ValueError as exc:
        sys.exit(f"chorus train selector: {exc}")
    norms, _ = best_norms(answers, gold, len(args.member))
    router = fit_saved_router(args, data, [it.prompt for it in items], correctness(answers, gold, norms), secs)
    out = sel.save(artifact_path(args.out))
    cv = sel.training["cv"]
    print(f"selector {args.out}: {len(items)} items of {data}, members {', '.join(args.member)}")
    print(f"  cross-validated ({args.folds} folds): selector {100 * cv['selector_acc']:.1f}, best member "
          f"{100 * cv['best_member_acc']:.1f}, gain {100 * cv['gain']:+.1f} [{100 * cv['gain_ci'][0]:+.1f}, "
          f"{100 * cv['gain_ci'][1]:+.1f}] (McNemar p = {cv['mcnemar_p']:.2f}), oracle {100 * cv['oracle_acc']:.1f}")
    if sel.fallback:
        print(f"  falls back to {sel.fallback}: {sel.training['fallback_reason']}")
    print(router_line(args, router))
    print(f"  written to {out.parent}")
    return 0


def fit_saved_router(args: argparse.Namespace, data: Path, texts: list[str], right: np.ndarray,
                     costs: dict[str, float]) -> Any:
    """The prompt-only router fit on ``texts`` (``right``: (items, members)), saved as ``router.json``."""
    from chorus.ensembles.fitted.artifact import artifact_path
    from chorus.ensembles.similarity import Embedder
    from chorus.training.selector import data_hash, fit_router

    try:
        router = fit_router(args.member, Embedder.embed(texts), right, [costs[m] for m in args.member],
                            margin=args.margin, data_hash=f"{data_hash(data)}:{args.offset}:{args.limit}",
                            folds=args.folds, seed=args.seed)
    except ValueError as exc:
        sys.exit(f"chorus train selector: {exc}")
    router.save(artifact_path(args.out))
    return router


def router_line(args: argparse.Namespace, router: Any) -> str:
    rcv = router.training["cv"]
    return (f"  router (k = {router.k}, margin {args.margin:g}): cross-validated {100 * rcv['router_acc']:.1f}, "
            f"{rcv['share_to_best']:.0%} of the calls to the best member"
            + (f"; falls back to {router.fallback}" if router.fallback else ""))


def train_router_only(args: argparse.Namespace, data: Path) -> int:
    from chorus.bench.selector import prices
    from chorus.clients.eval_generative import member_outcomes
    from chorus.ensembles.fitted.artifact import artifact_path

    items, right, secs = member_outcomes(args.url, data, args.member, Path(args.cache), offset=args.offset,
                                         limit=args.limit, concurrency=args.concurrency, max_tokens=args.max_tokens)
    costs = prices(args.price, args.member) or {m: float(secs[:, k].mean()) for k, m in enumerate(args.member)}
    router = fit_saved_router(args, data, [it.text for it in items], right, costs)
    print(f"router {args.out}: {len(items)} generative items of {data}, members {', '.join(args.member)} "
          f"(accuracy " + ", ".join(f"{m} {100 * right[:, k].mean():.1f}" for k, m in enumerate(args.member)) + ")")
    print(router_line(args, router))
    print("  no selector: the select strategy scores choices, and these items have none")
    print(f"  written to {artifact_path(args.out)}")
    return 0


def train_selector_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="a running chorus (its /v1 URL)")
    p.add_argument("--data", required=True, help="labelled JSONL, as chorus eval reads it: multiple choice "
                   "(choices, label, question | goal | context) or generative (prompt | question, answer: router only)")
    p.add_argument("--member", action="append", default=[], help="a served model (repeat, in order; >= 2)")
    p.add_argument("--out", required=True, help="the selector's name: written to $CHORUS_HOME/selectors/NAME")
    p.add_argument("--cache", default="runs/eval-cache", help="per-item member scores (shared with chorus eval)")
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--limit", type=int)
    p.add_argument("--folds", type=int, default=5, help="cross-validation folds (regularisation and the fallback)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--margin", type=float, default=0.0,
                   help="router: a cheaper member answers when its predicted accuracy is within this of the best")
    p.add_argument("--price", action="append", default=[], help="router: MEMBER=COST per item (repeat; default: "
                   "the members' measured seconds per item)")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=16, help="generative items: tokens per answer")
