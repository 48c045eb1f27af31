"""``chorus eval`` on multiple-choice data (rows with ``choices`` and ``label``), through ``/v1/choices``.

Prompts are lm-evaluation-harness's for these sets: ``Question: {goal or question}\\nAnswer:`` followed by
" " + choice (PIQA, ARC), and the ``context`` followed by " " + ending (HellaSwag). Systems:

* ``--model NAME``: a served model or named ensemble, scored item by item;
* ``--ensemble JSON``: an ensemble in the request body (``label`` and ``combine`` keys are read here);
* ``--mix JSON``: an ensemble computed from the cached scores of models run in the same invocation,
  without calling them again: ``{"label", "members": [...], "pool": "linear" | "log" | "confident" |
  "tokens" | "calibrated", "weights": null | [...] | "fit"}``. ``fit`` uses 2-fold cross-fitting: the
  weights for each half of the items are fitted on the other half (disjoint), by the gold choices'
  log-likelihood, per normalisation; ``calibrated`` fits each member's temperature that way, then averages.

``--cache DIR`` keeps every model's per-item scores (JSONL, one file per data file and system), so a
rerun, or another mix, reuses them. The table gives acc and acc_norm with Wilson 95% intervals and,
for every ensemble, the difference from its best member (on the same items) with a paired bootstrap
95% interval and McNemar's exact p, and the cost per item (member calls, tokens, seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from chorus import stats as S
from chorus.clients.local import markdown_table

NORMS = ("sum", "mean", "char")  # what the runs ask for (``unconditional`` costs a second pass)


@dataclass
class Item:
    id: str
    prompt: str
    choices: list[str]
    label: int


@dataclass
class Scored:
    """One system's per-item records, in item order."""

    label: str
    records: list[dict[str, Any]]
    members: list[str] = field(default_factory=list)  # ensembles: the member systems
    note: str = ""
    served: bool = False  #: an ensemble the server ran (not a mix of cached scores)
    pool: str = ""  #: how its members combine: a mix's pool; a served one's "linear" or "tokens"

    def probs(self, norm: str) -> np.ndarray:
        width = max(len(r["probabilities"][norm]) for r in self.records)
        out = np.zeros((len(self.records), width))
        for i, r in enumerate(self.records):
            p = r["probabilities"][norm]
            out[i, : len(p)] = p
        return out

    def correct(self, norm: str, gold: np.ndarray) -> np.ndarray:
        return (self.probs(norm).argmax(axis=1) == gold).astype(int)

    def per_item(self, key: str) -> float:
        return float(np.mean([r[key] for r in self.records]))


def is_multiple_choice(path: Path) -> bool:
    with path.open() as f:
        first = json.loads(next((line for line in f if line.strip()), "{}"))
    return isinstance(first, dict) and "choices" in first and "label" in first


def load_items(path: Path, offset: int, limit: int | None) -> list[Item]:
    items = []
    with path.open() as f:
        rows = [line for line in f if line.strip()]
    for n, line in enumerate(rows[offset:], offset + 1):
        row = json.loads(line)
        try:
            question = row.get("question", row.get("goal"))
            if "context" in row:  # a passage (with a question), or a sentence to complete (HellaSwag)
                prompt = f"{row['context']}\nQuestion: {question}\nAnswer: " if question else row["context"] + " "
            else:
                prompt = f"Question: {question}\nAnswer: "
            items.append(Item(str(row.get("id", n)), prompt, list(row["choices"]), int(row["label"])))
        except (KeyError, TypeError, ValueError) as exc:
            raise SystemExit(f"chorus eval: {path}:{n}: need 'choices', 'label' and a question ({exc})") from None
        if limit is not None and len(items) >= limit:
            break
    return items


def cache_file(cache: Path, data: Path, label: str) -> Path:
    tag = hashlib.sha256(str(data.resolve()).encode()).hexdigest()[:8]
    return cache / f"{data.stem}-{tag}" / (re.sub(r"[^A-Za-z0-9._+-]", "_", label) + ".jsonl")


async def score_item(http: httpx.AsyncClient, body: dict[str, Any], item: Item) -> dict[str, Any]:
    t0 = time.perf_counter()
    r = await http.post("/choices", json={**body, "prompt": item.prompt, "choices": item.choices,
                                          "normalisations": list(NORMS)})
    if r.status_code != 200:
        raise RuntimeError(f"{item.id}: {r.status_code}: {r.text[:300]}")
    data = r.json()
    calls = (data.get("ensemble") or {}).get("usage", {}).get("calls", 1)
    choices = data["choices"]
    return {"id": item.id, "label": item.label, "probabilities": {n: [c["probabilities"][n] for c in choices]
                                                                  for n in NORMS},
            "logprobs": [c["logprob"] for c in choices], "tokens": [c["tokens"] for c in choices],
            "token_logprobs": [c.get("token_logprobs") for c in choices], "chars": [len(c) for c in item.choices],
            "usage_tokens": data["usage"]["total_tokens"], "calls": calls, "seconds": time.perf_counter() - t0}


def read_cache(cached: Path | None) -> dict[str, dict[str, Any]]:
    if cached is None or not cached.is_file():
        return {}
    return {rec["id"]: rec for rec in map(json.loads, cached.read_text().splitlines())}


async def run_system(http: httpx.AsyncClient, label: str, body: dict[str, Any], items: list[Item],
                     cached: Path | None, concurrency: int) -> Scored:
    have = read_cache(cached)
    todo = [it for it in items if it.id not in have]
    print(f"{label}: {len(items)} items, {len(items) - len(todo)} cached", file=sys.stderr, flush=True)
    gate = asyncio.Semaphore(concurrency)
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
    out = cached.open("a") if cached is not None else None
    try:
        async def one(item: Item) -> None:
            async with gate:
                rec = await score_item(http, body, item)
            have[item.id] = rec
            if out is not None:
                out.write(json.dumps(rec) + "\n")
                out.flush()

        await asyncio.gather(*(one(it) for it in todo))
    finally:
        if out is not None:
            out.close()
    return Scored(label, [have[it.id] for it in items])


def mix(spec: dict[str, Any], runs: dict[str, Scored], gold: np.ndarray) -> Scored:
    """An ensemble from cached member scores (no model is called)."""
    label, names = spec.get("label") or "+".join(spec["members"]), spec["members"]
    pool, weights = spec.get("pool", "linear"), spec.get("weights")
    missing = [n for n in names if n not in runs]
    if missing:
        raise SystemExit(f"chorus eval: --mix {label}: members {missing} are not among the systems run")
    if pool not in S.POOLS:
        raise SystemExit(f"chorus eval: --mix {label}: pool must be one of {', '.join(S.POOLS)}")
    members = [runs[n] for n in names]
    m, n_items = len(members), len(gold)
    half = n_items // 2
    folds = [(np.arange(0, half), np.arange(half, n_items)), (np.arange(half, n_items), np.arange(0, half))]
    plans: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}  # normalisation -> [(items, weights)]
    note = ""
    if pool == "calibrated":  # each member's temperature fitted on the other half, then an equal average
        return calibrated(label, members, names, folds, gold)
    if weights == "fit":  # per normalisation, each half's weights fitted on the other half
        if pool == "tokens":
            raise SystemExit(f"chorus eval: --mix {label}: fitted weights are for probability pools")
        for nm in NORMS:
            plans[nm] = [(apply_to, S.fit_weights([s.probs(nm)[fit_on] for s in members], gold[fit_on], pool))
                         for fit_on, apply_to in folds]
        note = "weights fitted on the other half: " + "; ".join(
            f"{NAMES[nm]} " + " / ".join("[" + ", ".join(f"{x:.2f}" for x in w) + "]" for _, w in plans[nm])
            for nm in ("sum", "char"))
    else:
        w = np.array(weights if weights is not None else [1.0] * m, dtype=float)
        if len(w) != m:
            raise SystemExit(f"chorus eval: --mix {label}: {m} members, {len(w)} weights")
        plans = {nm: [(np.arange(n_items), w)] for nm in NORMS}
    records: list[dict[str, Any]] = [{"probabilities": {}} for _ in range(n_items)]
    for nm, plan in plans.items():
        for idx, w in plan:
            p = token_pool(members, idx, w, nm) if pool == "tokens" else S.combine(
                [s.probs(nm)[idx] for s in members], w, pool)
            for row, i in enumerate(idx):
                records[i]["probabilities"][nm] = p[row].tolist()
    add_costs(records, members)
    return Scored(label, records, names, note, pool=pool)


def add_costs(records: list[dict[str, Any]], members: list[Scored]) -> None:
    """A mix costs what its members cost, item by item (it calls no model itself)."""
    for i, rec in enumerate(records):
        rec.update({key: sum(s.records[i][key] for s in members) for key in ("usage_tokens", "calls", "seconds")})


def calibrated(label: str, members: list[Scored], names: list[str], folds: list[tuple[np.ndarray, np.ndarray]],
               gold: np.ndarray) -> Scored:
    records: list[dict[str, Any]] = [{"probabilities": {}} for _ in range(len(gold))]
    temps: dict[str, list[list[float]]] = {}
    for nm in NORMS:
        for fit_on, apply_to in folds:
            ts = [S.fit_temperature(s.probs(nm)[fit_on], gold[fit_on]) for s in members]
            temps.setdefault(nm, []).append(ts)
            p = np.mean([S.sharpen(s.probs(nm)[apply_to], t) for s, t in zip(members, ts)], axis=0)
            for row, i in enumerate(apply_to):
                records[i]["probabilities"][nm] = p[row].tolist()
    add_costs(records, members)
    note = "temperatures fitted on the other half: " + "; ".join(
        f"{NAMES[nm]} " + " / ".join("[" + ", ".join(f"{t:.2g}" for t in ts) + "]" for ts in temps[nm])
        for nm in ("sum", "char"))
    return Scored(label, records, names, note, pool="calibrated")


def agreement(systems: list[Scored]) -> list[str]:
    """For every served ensemble with a mix of the same members and pooling (equal weights both): the largest
    difference of any choice's probability between the server's answer and the combination of cached scores."""
    lines = []
    for served in (s for s in systems if s.served):
        for mixed in (s for s in systems if not s.served and s.members == served.members and s.pool == served.pool
                      and not s.note):
            diff = max(float(np.abs(served.probs(n) - mixed.probs(n)).max()) for n in NORMS)
            lines.append(f"- {served.label} (served) vs {mixed.label} (from cached scores): largest |difference| of "
                         f"a choice's probability {diff:.1e} over {len(served.records)} items")
    return lines


def token_pool(members: list[Scored], idx: np.ndarray, w: np.ndarray, norm: str) -> np.ndarray:
    """Per-token mixture of members that share one tokenization, from their cached token logprobs."""
    rows = []
    for i in idx:
        recs = [s.records[i] for s in members]
        if any(None in r["token_logprobs"] for r in recs) or len({tuple(r["tokens"]) for r in recs}) != 1:
            raise SystemExit("chorus eval: a 'tokens' mix needs members run with one tokenizer (token logprobs)")
        lps = np.array([S.token_mixture([r["token_logprobs"][c] for r in recs], w)
                        for c in range(len(recs[0]["tokens"]))])
        rows.append(S.normalised_probabilities(lps, np.array(recs[0]["tokens"]), np.array(recs[0]["chars"]), norm))
    width = max(len(r) for r in rows)
    return np.array([np.pad(r, (0, width - len(r))) for r in rows])


def report(systems: list[Scored], gold: np.ndarray) -> str:
    runs = {s.label: s for s in systems}
    header = ["system", "n"]
    for metric in ("acc", "acc_norm"):
        header += [f"{metric} [95% CI]", f"Δ {metric} vs best member [95% CI], McNemar p"]
    header += ["calls/item", "tokens/item", "s/item"]
    rows = []
    for s in systems:
        cells = [s.label, str(len(gold))]
        for nm in ("sum", "char"):
            c = s.correct(nm, gold)
            lo, hi = S.accuracy_interval(c)
            cells.append(f"{100 * c.mean():.1f} [{100 * lo:.1f}, {100 * hi:.1f}]")
            if s.members:
                best = max(s.members, key=lambda n: runs[n].correct(nm, gold).mean())
                d = S.paired_difference(c, runs[best].correct(nm, gold))
                cells.append(f"{100 * d.delta:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}], p={d.p_mcnemar:.2f} "
                             f"vs {best} (+{d.wins}/-{d.losses})")
            else:
                cells.append("-")
        cells += [f"{s.per_item('calls'):.1f}", f"{s.per_item('usage_tokens'):.0f}", f"{s.per_item('seconds'):.2f}"]
        rows.append(cells)
    notes = [f"- {s.label}: {s.note}" for s in systems if s.note]
    return markdown_table(header, rows) + ("\n" + "\n".join(notes) if notes else "")


NAMES = {"sum": "acc", "char": "acc_norm", "mean": "acc_mean"}


async def evaluate(args: argparse.Namespace, url: str, headers: dict[str, str]) -> str:
    data = Path(args.data)
    items = load_items(data, args.offset, args.limit)
    if not items:
        raise SystemExit(f"chorus eval: no items in {data}")
    gold = np.array([it.label for it in items])
    cache = Path(args.cache) if args.cache else None
    systems: list[Scored] = []
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, headers=headers) as http:
        cards = (await http.get("/models")).json().get("data", [])
        # token logprobs (for 'tokens' mixes) from language models; ensembles and scorer models have none
        plain = {c["id"] for c in cards if not c.get("ensemble") and c.get("kind") != "scorer"}
        for name in args.model or []:
            cached = cache_file(cache, data, name) if cache else None
            asked = {"model": name, "logprobs": True} if name in plain else {"model": name}
            systems.append(await run_system(http, name, asked, items, cached, args.concurrency))
        for i, raw in enumerate(args.ensemble or []):
            spec = json.loads(raw)
            label = spec.pop("label", None) or f"{spec.get('strategy', 'ensemble')}#{i + 1}"
            body: dict[str, Any] = {"model": spec.pop("model", label), "ensemble": spec, "trace": True}
            if "combine" in spec:
                body["combine"] = spec.pop("combine")
            cached = cache_file(cache, data, label) if cache else None
            scored = await run_system(http, label, body, items, cached, args.concurrency)
            members = [m if isinstance(m, str) else m["model"] for m in spec.get("members") or []]
            scored.members = [m for m in members if m in {s.label for s in systems}]
            scored.served = True
            one_vocab = spec.get("strategy") == "logit_average" and spec.get("align", "vocab") == "vocab"
            scored.pool = "tokens" if one_vocab and body.get("combine", "tokens") == "tokens" else "linear"
            systems.append(scored)
    runs = {s.label: s for s in systems}
    for raw in args.mix or []:
        s = mix(json.loads(raw), runs, gold)
        runs[s.label] = s
        systems.append(s)
    title = (f"{len(items)} items of {data} (from item {args.offset}); acc = summed log-likelihood, acc_norm = "
             "per character")
    return "\n".join([title, report(systems, gold), *agreement(systems)])


def member_answers(url: str, data: Path, members: list[str], cache: Path, *, offset: int = 0,
                   limit: int | None = None, concurrency: int = 1, timeout: float = 600.0,
                   headers: dict[str, str] | None = None) -> tuple[list[Any], list[list[dict[str, list[float]]]]]:
    """The items of ``data`` and, per item, every member's probabilities per normalisation (scored through
    ``url`` where the cache does not have them)."""
    items = load_items(data, offset, limit)
    if not items:
        raise SystemExit(f"chorus: no items in {data}")

    async def run() -> list[Any]:
        async with httpx.AsyncClient(base_url=url, timeout=timeout, headers=headers or {}) as http:
            return [await run_system(http, m, {"model": m, "logprobs": True}, items, cache_file(cache, data, m),
                                     concurrency) for m in members]

    runs = asyncio.run(run())
    answers = [[{nm: r.records[i]["probabilities"][nm] for nm in NORMS} for r in runs] for i in range(len(items))]
    return items, answers


def member_seconds(cache: Path, data: Path, members: list[str], ids: list[str]) -> dict[str, float]:
    out = {}
    for m in members:
        recs = read_cache(cache_file(cache, data, m))
        out[m] = float(np.mean([recs[i]["seconds"] for i in ids if i in recs] or [0.0]))
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mix", action="append", help='multiple choice: an ensemble from cached member scores, e.g. '
                   '\'{"label": "avg", "members": ["a", "b"], "pool": "linear", "weights": "fit"}\' (repeatable)')
    p.add_argument("--offset", type=int, default=0, help="multiple choice: skip the first N items")
    p.add_argument("--cache", help="multiple choice: directory for per-item scores (reused by later runs)")
