"""`chorus train cascade`: the agreement cascade's thresholds, fitted on a train split for a target accuracy.

Input: for each train item, every member's sampled answers (members cheap to expensive) and the reference. A
member's confidence on an item is its agreement (`ensembles.answers.votes.agreement`: the share of its samples that
give its majority answer); the cascade accepts member ``i``'s majority answer when that share is at least
``tau_i``, else asks the next member; the last member always answers. Every combination of thresholds among the
agreement values the train split shows is simulated; the fit keeps the combination that asks the later members
least often while its train accuracy reaches ``target`` (ties: the higher accuracy); when none reaches it, the
most accurate one. The artifact (JSON) names the members (the served ensemble must list the same models in the
same order), the answer type, the samples per member, the thresholds, and what the fit saw.

`chorus train cascade` reads the answers `chorus eval gsm8k` cached (its train split); the target defaults to
the last member's own train accuracy (its majority answer), times ``--keep``.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chorus.ensembles.answers.votes import Unfinished, agreement, from_answers, tally
from chorus.ensembles.fitted.artifact import artifact_out
from chorus.ensembles.fitted.cascade import CascadeThresholds


def same(a: str, b: str) -> bool:
    """Answers compared as numbers where both are numbers, else as text."""
    try:
        return a != "" and float(a) == float(b)
    except ValueError:
        return a != "" and a == b


@dataclass
class Fit:
    thresholds: list[float]
    accuracy: float  # on the train rows
    escalated: float  # share of items that reached the second member
    calls: float  # members asked per item, on average
    n: int


def simulate(confs: list[list[tuple[float, bool]]], thresholds: Sequence[float]) -> tuple[float, float, float]:
    """(accuracy, share escalated past the first member, members asked per item) over items whose members each
    have (agreement, right)."""
    right = escalated = asked = 0
    for item in confs:
        for i, (conf, ok) in enumerate(item):
            if i == len(item) - 1 or conf >= thresholds[i]:
                right += ok
                escalated += i > 0
                asked += i + 1
                break
    n = max(1, len(confs))
    return right / n, escalated / n, asked / n


def member_stats(rows: list[dict[str, Any]], compare: Callable[[str, str], bool] = same,
                 unfinished: Unfinished = "abstain") -> list[list[tuple[float, bool]]]:
    """Each row's members as (agreement, majority right). A row: ``members`` (each member's answers) and
    optionally ``finished`` (each member's answers: ended on their own, else cut at max_tokens); ``unfinished``
    decides as the served cascade's option does (``abstain``: cut answers do not vote while another finished)."""
    out = []
    for r in rows:
        item = []
        for answers, done in zip(r["members"], r.get("finished") or [None] * len(r["members"]), strict=True):
            samples = from_answers(answers, finished=done)
            share, answer = agreement(samples, tally(samples, unfinished=unfinished))
            item.append((share, compare(answer, r["reference"])))
        out.append(item)
    return out


def fit_thresholds(rows: list[dict[str, Any]], target: float, compare: Callable[[str, str], bool] = same,
                   unfinished: Unfinished = "abstain") -> Fit:
    confs = member_stats(rows, compare, unfinished)
    steps = len(confs[0]) - 1 if confs else 0
    grids = [sorted({item[i][0] for item in confs if item[i][0] > 0} | {1.0}) for i in range(steps)]
    best: tuple[tuple[float, ...], Fit] | None = None
    for combo in itertools.product(*grids):
        acc, esc, calls = simulate(confs, combo)
        fit = Fit(list(combo), acc, esc, calls, len(confs))
        key = ((0, calls, -acc) if acc >= target - 1e-12 else (1, -acc, calls)) + tuple(combo)
        if best is None or key < best[0]:
            best = (key, fit)
    assert best is not None
    return best[1]


def write_artifact(out: Path, members: list[str], fit: Fit, *, answer: str, samples: int, source: str,
                   target: float | None = None, unfinished: str = "abstain") -> Path:
    """The artifact as ``out/cascade.json`` (written atomically); its path."""
    return CascadeThresholds(
        members=members, thresholds=fit.thresholds, answer=answer, samples=samples, unfinished=unfinished,
        target=target, train={"n": fit.n, "accuracy": fit.accuracy, "escalated": fit.escalated,
                              "members_per_item": fit.calls, "source": source}).save(out)


def rows_from_cache(cache: Path, split: str, members: list[str], samples: int) -> list[dict[str, Any]]:
    """Train rows from `chorus eval gsm8k`'s cache: items where every member has ``samples`` answers."""
    per: list[dict[int, list[tuple[str, bool]]]] = []
    ref: dict[int, str] = {}
    for m in members:
        got: dict[int, list[tuple[str, bool]]] = {}
        path = cache / split / f"{m}.jsonl"
        for line in path.read_text().splitlines() if path.is_file() else []:
            r = json.loads(line)
            if r["kind"] == "sample":
                got.setdefault(r["item"], []).extend((c["answer"], c.get("finish_reason") != "length")
                                                     for c in r["choices"])
                ref[r["item"]] = r["reference"]
        per.append(got)
    items = sorted(i for i in ref if all(len(g.get(i, [])) >= samples for g in per))
    return [{"item": i, "members": [[a for a, _ in g[i][:samples]] for g in per],
             "finished": [[f for _, f in g[i][:samples]] for g in per], "reference": ref[i]} for i in items]


def main(args: argparse.Namespace) -> int:
    rows = rows_from_cache(Path(args.cache), args.split, args.member, args.samples)
    if not rows:
        raise SystemExit(f"no {args.split} item has {args.samples} cached samples of every member in {args.cache}")
    never = [2.0] * (len(args.member) - 1)  # thresholds above 1: always escalate, the last member alone
    last_alone = simulate(member_stats(rows, unfinished=args.unfinished), never)[0]
    target = args.target if args.target is not None else last_alone * args.keep
    fit = fit_thresholds(rows, target, unfinished=args.unfinished)
    path = write_artifact(artifact_out(args.out), args.member, fit, answer="number", samples=args.samples,
                          source=f"{args.cache} ({args.split}, {len(rows)} items)", target=target,
                          unfinished=args.unfinished)
    print(f"{path}: thresholds {fit.thresholds}; train n={fit.n}: accuracy {fit.accuracy:.3f} (target "
          f"{target:.3f}; {args.member[-1]} alone {last_alone:.3f}), {100 * fit.escalated:.1f}% escalated")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--member", action="append", required=True, help="served model names, cheap to expensive")
    p.add_argument("--cache", default="docs/data/gsm8k", help="chorus eval gsm8k's answer cache")
    p.add_argument("--split", default="train")
    p.add_argument("--samples", type=int, default=4, help="samples per member (the served cascade's 'samples')")
    p.add_argument("--target", type=float, help="train accuracy to keep (default: the last member's, x --keep)")
    p.add_argument("--keep", type=float, default=1.0, help="share of the last member's train accuracy to keep")
    p.add_argument("--out", default="gsm8k-cascade",
                   help="a name in $CHORUS_HOME/selectors (served as the cascade's artifact), or a folder path")
    p.add_argument("--unfinished", choices=["abstain", "vote"], default="abstain",
                   help="samples cut at max_tokens: abstain while another finished (the served default), or vote; "
                        "the served cascade must use the same")
