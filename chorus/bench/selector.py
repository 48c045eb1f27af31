"""``chorus bench selector``: the evaluation protocol of a learned selector, fit on one split and reported on
another that nothing was tuned on.

The members score both splits through a running chorus (``/v1/choices``, cached as ``chorus eval --cache``
caches them). The selector is fit on the training split only (its regularisation and its fallback decided by
cross-validation inside it) and saved to ``$CHORUS_HOME/selectors/NAME``; every row of the table is then
computed on the held-out split: each member, the best single member *chosen on the training split*, the
uniform average of the members' probabilities, the selector, a random member per item (seeded), and the
oracle (some member right). Accuracy is the summed log-likelihood's (lm-eval's ``acc``), with Wilson 95%
intervals; differences from the best-on-train member with a paired bootstrap 95% interval and McNemar's exact
p; the share of the best-to-oracle gap closed; cost per item (member calls, tokens, seconds). Finally the
served ``select`` ensemble is asked on the first ``--served-check`` held-out items and must give the offline
probabilities (the largest difference is printed).

Generative items (``prompt`` or ``question``, and ``answer``; chorus/clients/eval_generative.py) get the
router's protocol only: each member, the best on train, a random member, the oracle, the router at several
margins and the share of calls it sends to the best member, and a check that the served ``route`` ensemble
picks the offline router's member.

A file given to both ``--train`` and ``--test`` (HellaSwag and PIQA have one labelled split here) is split into
two disjoint halves by ``--split-seed``: the training half and the held-out half.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import numpy as np

from chorus import stats as S
from chorus.clients.eval_choices import member_answers, member_seconds
from chorus.clients.local import markdown_table
from chorus.ensembles.fitted.artifact import artifact_path
from chorus.training.selector import best_norms, correctness, data_hash, fit_router, fit_selector


def halves(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.random.default_rng(seed).permutation(n)
    return np.sort(order[: n // 2]), np.sort(order[n // 2 :])


Row = tuple[str, np.ndarray, float, float]  #: system, per-item correctness, calls and seconds per item


def rows_of(sel: Any, members: list[str], answers: list[Any], gold: np.ndarray, prompts: list[int],
            best_on_train: int, norms: list[str], secs: list[float], seed: int) -> list[Row]:
    """The table's rows on the held-out items; every member under the normalisation that was best for it on the
    training split (``norms``); ``secs``: each member's seconds per item."""
    m, every = len(members), float(sum(secs))
    right = correctness(answers, gold, norms)
    out: list[Row] = [(f"{name} ({NORM_NAMES[norms[k]]})", right[:, k], 1.0, secs[k]) for k, name in enumerate(members)]
    out.append((f"best on train ({members[best_on_train]}, {NORM_NAMES[norms[best_on_train]]})",
                right[:, best_on_train], 1.0, secs[best_on_train]))
    avg = [int(np.argmax(np.mean([a[k][norms[k]] for k in range(m)], axis=0))) for a in answers]
    out.append(("uniform average", (np.array(avg) == gold).astype(int), float(m), every))
    if sel.fallback:
        k = members.index(sel.fallback)
        out.append((f"select (falls back to {sel.fallback})", right[:, k], 1.0, secs[k]))
        learner = dataclasses.replace(sel, fallback=None)  # what the learner would have given: shown, not served
        chosen = [int(np.argmax(learner.probabilities(a, n)["sum"])) for a, n in zip(answers, prompts)]
        out.append(("select's learner (not served)", (np.array(chosen) == gold).astype(int), float(m), every))
    else:
        chosen = [int(np.argmax(sel.probabilities(a, n)["sum"])) for a, n in zip(answers, prompts)]
        out.append(("select", (np.array(chosen) == gold).astype(int), float(m), every))
    pick = np.random.default_rng(seed).integers(m, size=len(gold))
    out.append(("random member", right[np.arange(len(gold)), pick], 1.0, float(np.mean(secs))))
    out.append(("oracle (some member right)", right.max(axis=1), float(m), every))
    return out


NORM_NAMES = {"sum": "acc", "mean": "acc per token", "char": "acc_norm"}


def table(systems: list[Row], reference: np.ndarray, oracle: float) -> str:
    best = float(reference.mean())
    header = ["system", "n", "acc [95% CI]", "Δ vs best on train [95% CI], McNemar p", "gap closed",
              "calls/item", "s/item"]
    rows = []
    for name, right, calls, seconds in systems:
        lo, hi = S.accuracy_interval(right)
        d = S.paired_difference(right, reference)
        delta = (f"{100 * d.delta:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}], p={d.p_mcnemar:.2f} "
                 f"(+{d.wins}/-{d.losses})")
        gap = f"{(right.mean() - best) / (oracle - best):+.0%}" if oracle > best else "-"
        rows.append([name, str(len(right)), f"{100 * right.mean():.1f} [{100 * lo:.1f}, {100 * hi:.1f}]", delta, gap,
                     f"{calls:.1f}", f"{seconds:.2f}"])
    return markdown_table(header, rows)


def main(args: argparse.Namespace) -> int:
    import httpx


    members, cache = args.member, Path(args.cache)
    same = Path(args.train).resolve() == Path(args.test).resolve()
    tr_items, tr_answers = member_answers(args.url, Path(args.train), members, cache, limit=args.train_limit,
                                          concurrency=args.concurrency)
    if same:
        a, b = halves(len(tr_items), args.split_seed)
        te_items, te_answers = [tr_items[i] for i in b], [tr_answers[i] for i in b]
        tr_items, tr_answers = [tr_items[i] for i in a], [tr_answers[i] for i in a]
        split = f"two disjoint halves of {args.train} (seed {args.split_seed})"
    else:
        te_items, te_answers = member_answers(args.url, Path(args.test), members, cache, limit=args.test_limit,
                                              concurrency=args.concurrency)
        split = f"train {args.train}, held out {args.test}"
    tr_gold = np.array([it.label for it in tr_items])
    te_gold = np.array([it.label for it in te_items])
    sel = fit_selector(members, tr_answers, tr_gold, [len(it.prompt) for it in tr_items],
                       data_hash=f"{data_hash(Path(args.train))}:{args.train_limit}", seed=args.seed)
    sel.save(artifact_path(args.name))
    norms, best = best_norms(tr_answers, tr_gold, len(members))
    secs = member_seconds(cache, Path(args.test), members, [it.id for it in te_items])
    systems = rows_of(sel, members, te_answers, te_gold, [len(it.prompt) for it in te_items], best, norms,
                      [secs[m] for m in members], args.seed)
    reference = systems[len(members)][1]
    oracle = float(systems[-1][1].mean())
    train_secs = prices(args.price, members) or member_seconds(cache, Path(args.train), members,
                                                              [it.id for it in tr_items])
    router_text, _ = routing(args, members, [it.prompt for it in tr_items], correctness(tr_answers, tr_gold, norms),
                             [it.prompt for it in te_items], correctness(te_answers, te_gold, norms), train_secs,
                             secs, best, reference)
    cv = sel.training["cv"]
    print(f"## {len(te_items)} held-out items; {split}; {len(tr_items)} training items; members "
          f"{', '.join(members)}\n")
    print(table(systems, reference, oracle))
    print(f"\n- selector {args.name}: C = {sel.C} by {sel.training['folds']}-fold cross-validation on the training "
          f"items; cross-validated gain over the best member {100 * cv['gain']:+.1f} [{100 * cv['gain_ci'][0]:+.1f}, "
          f"{100 * cv['gain_ci'][1]:+.1f}]" + (f"; falls back to {sel.fallback}" if sel.fallback else "; served"))
    print(router_text)
    if args.served_check:
        ensemble = {"strategy": "select", "artifact": args.name, "members": members}
        worst = 0.0
        with httpx.Client(base_url=args.url, timeout=600) as http:
            for it, ans in list(zip(te_items, te_answers))[: args.served_check]:
                r = http.post("/choices", json={"model": members[0], "prompt": it.prompt, "choices": it.choices,
                                                "normalisations": ["sum"], "ensemble": ensemble})
                r.raise_for_status()
                got = [c["probabilities"]["sum"] for c in r.json()["choices"]]
                worst = max(worst, float(np.abs(np.array(got) - sel.probabilities(ans, len(it.prompt))["sum"]).max()))
        print(f"- the served select ensemble vs the offline selector on the first {args.served_check} held-out "
              f"items: largest |difference| of a choice's probability {worst:.1e}")
    return 0


MARGINS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3)


def prices(given: list[str], members: list[str]) -> dict[str, float]:
    """``MEMBER=COST`` pairs, one for every member (or none)."""
    out = {}
    for pair in given:
        name, _, value = pair.partition("=")
        try:
            out[name] = float(value)
        except ValueError:
            sys.exit(f"chorus: --price {pair!r}: need MEMBER=NUMBER")
    if out and set(out) != set(members):
        sys.exit(f"chorus: --price needs one price for every member ({', '.join(members)})")
    return out


def routing(args: argparse.Namespace, members: list[str], tr_texts: list[str], tr_right: np.ndarray,
            te_texts: list[str], te_right: np.ndarray, train_secs: dict[str, float], secs: dict[str, float],
            best: int, reference: np.ndarray) -> tuple[str, np.ndarray]:
    """Fit the prompt-only router on the training items (``tr_right``: (items, members) correctness), save it
    beside the selector, and report it on the held-out items at several margins: accuracy against cost, and the
    share of calls sent to the best member. Also returns the held-out choices at the fitted margin."""
    from chorus.ensembles.similarity import Embedder

    router = fit_router(members, Embedder.embed(tr_texts), tr_right, [train_secs[m] for m in members],
                        data_hash=f"{data_hash(Path(args.train))}:router", seed=args.seed)
    router.save(artifact_path(args.name))
    preds = [router.predict(q)[0] for q in Embedder.embed(te_texts)]
    learned = dataclasses.replace(router, fallback=None)  # the table shows the routing even where it falls back
    best_acc = float(reference.mean())
    best_lo, _ = S.accuracy_interval(reference)
    rows, reached, within = [], None, None
    n = len(te_right)
    for margin in MARGINS:
        chosen = np.array([learned.choose(p, margin) for p in preds])
        got = te_right[np.arange(n), chosen]
        lo, hi = S.accuracy_interval(got)
        d = S.paired_difference(got, reference)
        share = float((chosen == best).mean())
        if got.mean() >= best_acc and (reached is None or share < reached[1]):
            reached = (margin, share)
        if got.mean() >= best_lo and (within is None or share < within[1]):
            within = (margin, share)
        rows.append([f"{margin:g}", f"{100 * got.mean():.1f} [{100 * lo:.1f}, {100 * hi:.1f}]",
                     f"{100 * d.delta:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}], p={d.p_mcnemar:.2f}",
                     f"{share:.0%}", f"{np.mean([secs[members[c]] for c in chosen]):.2f}"])
    cv = router.training["cv"]
    what = "prices given" if args.price else "training seconds per item"
    head = (f"\n### Prompt-only router (k = {router.k} by cross-validation; costs ({what}): "
            + ", ".join(f"{m} {train_secs[m]:.3g}" for m in members) + ")\n")
    lines = [head, markdown_table(["margin", "acc [95% CI]", "Δ vs best on train [95% CI], McNemar p",
                                   f"calls to {members[best]}", "s/item"], rows), "",
             f"- cross-validated on the training items at margin 0: {100 * cv['router_acc']:.1f} against the best "
             f"member's {100 * cv['best_member_acc']:.1f} ({100 * cv['gain']:+.1f} [{100 * cv['gain_ci'][0]:+.1f}, "
             f"{100 * cv['gain_ci'][1]:+.1f}])" + (f"; served: falls back to {router.fallback}" if router.fallback
                                                  else "; served as routed"),
             "- the smallest share of calls to the best member that keeps its held-out accuracy: "
             + (f"{reached[1]:.0%} (margin {reached[0]:g})" if reached else "not reached at any margin"),
             f"- ... that stays within its 95% interval (>= {100 * best_lo:.1f}): "
             + (f"{within[1]:.0%} (margin {within[0]:g})" if within else "not reached at any margin")]
    return "\n".join(lines), np.array([router.choose(p) for p in preds])


def generative(args: argparse.Namespace) -> int:
    """The protocol on labelled generative items (prompt / question and answer): only the router applies (the
    ``select`` strategy reads per-choice scores). Rows: each member, the best on train, a random member, the
    oracle; then the router at several margins."""
    import httpx

    from chorus.clients.eval_generative import member_outcomes

    members, cache = args.member, Path(args.cache)
    kw = {"concurrency": args.concurrency, "max_tokens": args.max_tokens}
    tr_items, tr_right, tr_secs = member_outcomes(args.url, Path(args.train), members, cache,
                                                  limit=args.train_limit, **kw)
    if Path(args.train).resolve() == Path(args.test).resolve():
        a, b = halves(len(tr_items), args.split_seed)
        te_items, te_right, te_secs = [tr_items[i] for i in b], tr_right[b], tr_secs[b]
        tr_items, tr_right, tr_secs = [tr_items[i] for i in a], tr_right[a], tr_secs[a]
        split = f"two disjoint halves of {args.train} (seed {args.split_seed})"
    else:
        te_items, te_right, te_secs = member_outcomes(args.url, Path(args.test), members, cache,
                                                      limit=args.test_limit, **kw)
        split = f"train {args.train}, held out {args.test}"
    best = int(tr_right.mean(axis=0).argmax())
    secs = {m: float(te_secs[:, k].mean()) for k, m in enumerate(members)}
    n, m = len(te_items), len(members)
    systems: list[Row] = [(name, te_right[:, k], 1.0, secs[name]) for k, name in enumerate(members)]
    systems.append((f"best on train ({members[best]})", te_right[:, best], 1.0, secs[members[best]]))
    pick = np.random.default_rng(args.seed).integers(m, size=n)
    systems.append(("random member", te_right[np.arange(n), pick], 1.0, float(np.mean(list(secs.values())))))
    systems.append(("oracle (some member right)", te_right.max(axis=1), float(m), float(sum(secs.values()))))
    reference = te_right[:, best]
    train_secs = prices(args.price, members) or {mm: float(tr_secs[:, k].mean()) for k, mm in enumerate(members)}
    router_text, chosen = routing(args, members, [it.text for it in tr_items], tr_right, [it.text for it in te_items],
                                  te_right, train_secs, secs, best, reference)
    print(f"## {n} held-out items; {split}; {len(tr_items)} training items; members {', '.join(members)}; "
          f"greedy, up to {args.max_tokens} tokens\n")
    print(table(systems, reference, float(systems[-1][1].mean())))
    print(router_text)
    if args.served_check:
        ensemble = {"strategy": "route", "router": "learned", "artifact": args.name, "members": members,
                    "trace": True}
        agree = 0
        with httpx.Client(base_url=args.url, timeout=600) as http:
            for it, c in list(zip(te_items, chosen))[: args.served_check]:
                body = {"model": members[0], "max_tokens": 1, "temperature": 0, "ensemble": ensemble}
                r = (http.post("/chat/completions", json={**body, "messages": [{"role": "user", "content": it.text}]})
                     if it.chat else http.post("/completions", json={**body, "prompt": it.text}))
                r.raise_for_status()
                agree += r.json()["ensemble"]["winner"]["member"] == members[c]
        print(f"- the served route ensemble chose the offline router's member on {agree} of the first "
              f"{min(args.served_check, n)} held-out items")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--train", required=True, help="labelled JSONL to fit on: multiple choice (choices, label) or "
                   "generative (prompt or question, answer: the router only)")
    p.add_argument("--test", required=True, help="held-out JSONL (the same file: two halves by --split-seed)")
    p.add_argument("--member", action="append", default=[], help="a served model (repeat, in order)")
    p.add_argument("--name", default="bench-selector", help="the artifact's name in $CHORUS_HOME/selectors")
    p.add_argument("--cache", default="runs/eval-cache")
    p.add_argument("--train-limit", type=int)
    p.add_argument("--test-limit", type=int)
    p.add_argument("--split-seed", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--price", action="append", default=[], help="router: MEMBER=COST per item (repeat; default: "
                   "the members' measured seconds per item on the training split)")
    p.add_argument("--served-check", type=int, default=20, help="held-out items asked of the served ensemble")
    p.add_argument("--max-tokens", type=int, default=16, help="generative items: tokens per answer")


def run(args: argparse.Namespace) -> int:
    if len(args.member) < 2:
        sys.exit("chorus bench selector: give at least two --member models")
    from chorus.clients.eval_generative import is_generative

    return generative(args) if is_generative(Path(args.train)) else main(args)


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))

