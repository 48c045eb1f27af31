"""Confidence of a sample from its own tokens (measures on written tables), the decision served `answer_vote` and
the replay share (filter, weights, picks), the verifier (fit, artifact, served), the GSM8K cache readers (cut answers
made whole, scores attached), and the served strategy over fake members of different sharpness through the openai
SDK, with its 400s."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from chorus.config import ChorusConfig
from chorus.engines.fake.engine import FakeEngine
from chorus.ensembles.answers.confidence import (
    Tokens,
    Watch,
    as_weight,
    kept,
    measure,
    stop_at,
    token_confidence,
    windows,
)
from chorus.ensembles.answers.decide import Rule, decide
from chorus.ensembles.answers.votes import Sample
from chorus.ensembles.fitted.verifier import Verifier, feature_names, sample_features
from chorus.training.verifier import cached_items, fit_verifier
from tests.helpers import LiveServer, gateway

# ---- measures ----


def test_token_confidence_is_minus_the_mean_top_k_logprob() -> None:
    assert token_confidence([-0.1, -2.0, -3.9]) == pytest.approx(2.0)
    assert token_confidence([]) == 0.0


@pytest.mark.parametrize(("how", "want"), [
    ("mean_logprob", -0.5),
    ("mean_confidence", 5.0),
    ("lowest_window", 2.0),  # windows of 2 over [9, 1, 3, 7]: 5, 2, 5
    ("bottom_10", 2.0),  # the lowest 10% of 3 windows: the lowest one
    ("tail", 5.0),  # the last 2 tokens: 3, 7
])
def test_measures_table(how: str, want: float) -> None:
    t = Tokens(lp=[-0.2, -0.8, -0.4, -0.6], conf=[9.0, 1.0, 3.0, 7.0])
    assert measure(t, how, window=2, tail=2) == pytest.approx(want)


def test_a_sample_shorter_than_the_window_is_one_window() -> None:
    assert list(windows([4.0, 6.0], 64)) == [5.0]
    assert measure(Tokens([], []), "mean_logprob") == float("-inf") and measure(Tokens([], []), "tail") == 0.0
    with pytest.raises(ValueError, match="unknown confidence measure"):
        measure(Tokens([-1.0], [1.0]), "loudest")


def test_keep_and_weights() -> None:
    assert kept([1.0, 5.0, 3.0, 5.0], 0.5) == [False, True, False, True]
    assert kept([1.0, 2.0], 0.01) == [False, True]  # at least one
    assert as_weight(-0.5, "mean_logprob") == pytest.approx(np.exp(-0.5)) and as_weight(7.0, "tail") == 7.0


# ---- the decision ----


def smp(answer: str, conf: float, n: int = 4, cut: bool = False, member: str = "m") -> Sample:
    return Sample(member, f"The answer is {answer}.", answer, mean_logprob=-1 / conf, tokens=n,
                  finish_reason="length" if cut else "stop", per_token=Tokens([-1 / conf] * n, [conf] * n))


SAMPLES = [smp("41", 2.0), smp("41", 3.0), smp("42", 20.0), smp("7", 1.0)]


@pytest.mark.parametrize(("rule", "answer"), [
    (Rule(), "41"),  # plain majority
    (Rule("mean_confidence", keep=0.25), "42"),  # only the most confident votes
    (Rule("mean_confidence", weigh="confidence"), "42"),  # 20 against 2 + 3
    (Rule("mean_logprob", weigh="confidence"), "41"),  # exp(-1/2) + exp(-1/3) against exp(-1/20)
    (Rule("mean_confidence", keep=0.5), "42"),  # 42 and one 41: a tie, broken by mean log-probability
    (Rule("tail", pick="most_confident"), "42"),
])
def test_decision_table(rule: Rule, answer: str) -> None:
    d = decide(SAMPLES, rule)
    assert d.answer == answer and d.ranked[0].canonical == answer


def test_a_pick_prefers_a_finished_sample_and_the_filter_is_traced() -> None:
    samples = [smp("41", 2.0), smp("99", 50.0, cut=True)]
    d = decide(samples, Rule("mean_confidence", pick="most_confident"))
    assert d.answer == "41" and d.confidence == [2.0, 50.0] and d.voted == [True, True]
    assert decide(samples, Rule("mean_confidence", pick="most_confident"), unfinished="vote").answer == "99"
    assert decide(SAMPLES, Rule("mean_confidence", keep=0.5)).voted == [False, True, True, False]


# ---- the verifier ----


def toy_groups(n: int, seed: int = 0) -> tuple[list[list[Sample]], list[list[bool]]]:
    """Items of 4 samples where the right answer is the sure one (confidence ~90, as the sharp fake's), not the
    most frequent (two hesitant samples, confidence ~4.5, as the doubting fake's)."""
    rng = np.random.default_rng(seed)

    def one(answer: str, conf: float, lp: float) -> Sample:
        return Sample("m", "", answer, mean_logprob=lp, tokens=int(rng.integers(20, 40)),
                      per_token=Tokens([lp] * 8, [conf] * 8))

    groups, right = [], []
    for _ in range(n):
        g = [one("1", float(rng.uniform(60, 95)), float(rng.uniform(-0.5, 0))),
             one("2", float(rng.uniform(3, 6)), float(rng.uniform(-5, -3))),
             one("2", float(rng.uniform(3, 6)), float(rng.uniform(-5, -3))),
             one("3", float(rng.uniform(3, 6)), float(rng.uniform(-5, -3)))]
        groups.append(g)
        right.append([s.canonical == "1" for s in g])
    return groups, right


def test_the_verifier_learns_what_majority_misses_and_round_trips(tmp_path: Path) -> None:
    groups, right = toy_groups(30)
    v = fit_verifier(groups, [["m"] * 4 for _ in groups], right, ["m"], confidence=True, window=2, tail=2)
    assert v.training["cv"]["pick_acc"] == 1.0 and v.training["cv"]["majority_acc"] == 0.0
    assert v.features == feature_names(["m"], True)
    loaded = Verifier.load(v.save(tmp_path))
    scores = loaded.scores(groups[0], ["m"] * 4)
    assert int(np.argmax(scores)) == 0
    assert decide(groups[0], Rule(pick="verifier"), verifier=loaded, models=["m"] * 4).answer == "1"
    assert decide(groups[0], Rule(weigh="verifier"), verifier=loaded, models=["m"] * 4).answer == "1"


def test_verifier_features_and_a_foreign_artifact(tmp_path: Path) -> None:
    x = sample_features([smp("1", 2.0, member="a"), smp("1", 4.0, member="b"), smp("", 1.0, cut=True)],
                        ["a", "b", "b"], ["a", "b"], False, 64, 64)
    assert x.shape == (3, len(feature_names(["a", "b"], False)))
    assert list(x[:, 0]) == [1.0, 1.0, 0.0] and list(x[:, 1]) == [1.0, 1.0, 0.0]  # agreement, finished
    assert list(x[:, -2]) == [1.0, 0.0, 0.0]  # member:a
    with pytest.raises(ValueError, match="token log-probabilities"):
        sample_features([Sample("a", "", "1")], ["a"], ["a"], True, 64, 64)
    (tmp_path / "verifier.json").write_text(json.dumps({"kind": "verifier", "format": 1, "members": ["m"],
                                                        "features": ["loudness"], "coef": [1.0], "intercept": 0.0,
                                                        "mean": [0.0], "scale": [1.0], "C": 1.0,
                                                        "confidence": False}))
    from chorus.errors import ConfigError
    with pytest.raises(ConfigError, match="retrain"):
        Verifier.load(tmp_path)


# ---- the GSM8K cache: cut answers made whole, scores attached ----


def test_cached_items_join_continuations_and_scores(tmp_path: Path) -> None:
    (tmp_path / "train").mkdir()
    base = tmp_path / "train" / "m"
    rows = [{"item": 0, "kind": "greedy", "seed": None, "reference": "18", "seconds": 1.0, "temperature": 0.0,
             "choices": [{"text": "16 - 3 = 13, 13 - 4 = ", "answer": "4", "finish_reason": "length", "tokens": 5}]},
            {"item": 0, "kind": "sample", "seed": 7, "reference": "18", "seconds": 2.0, "temperature": 0.7,
             "choices": [{"text": "The answer is 18.", "answer": "18", "finish_reason": "stop", "tokens": 4},
                         {"text": "The answer is 9.", "answer": "9", "finish_reason": "stop", "tokens": 4}]}]
    base.with_suffix(".jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    base.with_suffix(".continued.jsonl").write_text(json.dumps(
        {"item": 0, "kind": "greedy", "seed": None, "choice": 0, "budget": 768, "text": "9, 9 * 2 = 18. The answer "
         "is 18.", "finish_reason": "stop", "tokens": 11, "answer": "18", "seconds": 3.0}))
    base.with_suffix(".scored.jsonl").write_text(json.dumps(
        {"item": 0, "kind": "sample", "seed": 7, "choice": 1, "budget": 768, "k": 20, "lp": [-0.5, -1.5],
         "conf": [3.0, 1.0]}))
    it = cached_items(tmp_path, "train", ["m"])[0]
    g = it.greedy["m"]
    assert (g.answer, g.finish_reason, g.tokens) == ("18", "stop", 16) and g.text.endswith("The answer is 18.")
    assert [s.answer for s in it.samples["m"]] == ["18", "9"]
    assert it.samples["m"][0].per_token is None and it.samples["m"][1].mean_logprob == pytest.approx(-1.0)


# ---- served: answer_vote over fake members of different sharpness (greedy: each writes its script) ----

RIGHT, WRONG = "Step by step. The answer is 42.", "Hmm. The answer is 41."


@pytest.fixture(scope="module")
def fakes() -> dict[str, FakeEngine]:
    return {"doubt": FakeEngine("doubt", replies=[WRONG], sharpness=0.5, max_model_len=4000),
            "sharp": FakeEngine("sharp", replies=[RIGHT], sharpness=100.0, max_model_len=4000)}


@pytest.fixture(scope="module")
def server(fakes: dict[str, FakeEngine]) -> Iterator[LiveServer]:
    config = {"models": [{"name": n, "engine": "fake"} for n in fakes]}
    with gateway(ChorusConfig.model_validate(config), engines=dict(fakes), timeout=120) as srv:
        yield srv
    assert all(e.active_sessions == 0 for e in fakes.values())


@pytest.fixture
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def ask(client: openai.OpenAI, ensemble: dict[str, Any]) -> Any:
    body = {"strategy": "answer_vote", "members": ["doubt", "doubt", "sharp"], "samples": 1, "answer": "number",
            "temperature": 0, "trace": True, **ensemble}
    return client.chat.completions.create(model="ensemble", messages=[{"role": "user", "content": "How many?"}],
                                          extra_body={"ensemble": body})


@pytest.mark.parametrize(("rule", "answer"), [
    ({}, "41"),  # two hesitant samples outvote one sure one
    ({"confidence_by": "mean_confidence", "keep": 0.3}, "42"),
    ({"confidence_by": "lowest_window", "window": 4, "weigh": "confidence"}, "42"),
    ({"confidence_by": "tail", "pick": "most_confident"}, "42"),
])
def test_served_answer_vote_reads_its_samples_confidence(client: openai.OpenAI, rule: dict[str, Any],
                                                         answer: str) -> None:
    r = ask(client, rule)
    trace = r.model_extra["ensemble"]
    assert trace["winner"]["answer"] == answer and (RIGHT if answer == "42" else WRONG) == r.choices[0].message.content
    if rule:
        conf = trace["confidence"]["by_sample"]
        assert conf[2] > 3 * max(conf[0], conf[1])  # the sharp member is the sure one
        assert trace["confidence"]["rule"]["by"] == rule["confidence_by"]
    else:
        assert "confidence" not in trace


def test_served_verifier_picks_and_weighs(client: openai.OpenAI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    monkeypatch.setenv("CHORUS_HOME", str(tmp_path))
    from chorus.ensembles.fitted.artifact import selectors_dir

    groups, right = toy_groups(30)
    models = [["sharp", "doubt", "doubt", "doubt"] for _ in groups]  # the right, confident sample is sharp's
    fit_verifier(groups, models, right, ["doubt", "sharp"], confidence=True).save(selectors_dir() / "v")
    for how in ({"pick": "verifier"}, {"weigh": "verifier"}):
        r = ask(client, {"verifier": "v", **how})
        trace = r.model_extra["ensemble"]
        assert trace["winner"]["answer"] == "42" and len(trace["confidence"]["verifier"]) == 3
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, {"verifier": "v", "pick": "verifier", "members": ["sharp"]})
    assert isinstance(err.value.body, dict) and err.value.body["param"] == "ensemble.members"


@pytest.mark.parametrize(("ensemble", "param", "words"), [
    ({"keep": 0.5}, "ensemble.confidence_by", "needs a confidence measure"),
    ({"pick": "most_confident"}, "ensemble.confidence_by", "needs a confidence measure"),
    ({"confidence_by": "tail"}, "ensemble.confidence_by", "is read only by"),
    ({"confidence_by": "loudness"}, "ensemble.confidence_by", "mean_logprob"),
    ({"keep": 0}, "ensemble.keep", "greater than 0"),
    ({"top_logprobs": 21}, "ensemble.top_logprobs", "less than or equal"),
    ({"pick": "verifier"}, "ensemble.verifier", "need a verifier"),
    ({"verifier": "v"}, "ensemble.verifier", "is read only by"),
    ({"verifier": "missing", "pick": "verifier"}, "ensemble.verifier", "No verifier artifact"),
    ({"verifier": "../../etc", "pick": "verifier"}, "ensemble.verifier", "must name an artifact inside"),
    ({"confidence_by": "tail", "keep": 0.5, "stop": "beta", "samples": 8}, "ensemble.stop", "stop: none"),
    ({"top_logprobs": 5}, "ensemble.top_logprobs", "read only by"),  # never accepted and ignored
    ({"confidence_by": "tail", "keep": 0.5, "window": 16}, "ensemble.window", "read only by"),
    ({"confidence_by": "lowest_window", "keep": 0.5, "tail": 16}, "ensemble.tail", "read only by"),
])
def test_bad_confidence_rules_are_400s_naming_the_field(client: openai.OpenAI, ensemble: dict[str, Any], param: str,
                                                         words: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, ensemble)
    body = err.value.body
    assert isinstance(body, dict) and body["param"] == param and words in body["message"], body


# ---- the commands over the GSM8K cache: score, train verifier, bench confidence ----


def test_eval_gsm8k_score_scores_each_answer_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`chorus eval gsm8k-score`: each cached answer (a cut one made whole) echoed after its chat head through
    /v1/completions; its tokens' log-probabilities and top-k confidences kept, from the answer's first character;
    a rerun sends nothing."""
    import argparse

    from chorus.bench import gsm8k_score
    from tests.helpers import serve_fakes

    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text(json.dumps({"question": "Q0?", "answer": "x\n#### 42"}) + "\n")
    cache = tmp_path / "c" / "test"
    cache.mkdir(parents=True)
    rows = [{"item": 0, "kind": "greedy", "seed": None, "temperature": 0.0, "reference": "42", "seconds": 1.0,
             "choices": [{"text": "abc", "finish_reason": "length", "answer": "", "tokens": 3}]},
            {"item": 0, "kind": "sample", "seed": 5, "temperature": 0.7, "reference": "42", "seconds": 1.0,
             "choices": [{"text": "xyz", "finish_reason": "stop", "answer": "", "tokens": 3}]},
            {"item": 0, "kind": "sample", "seed": 6, "temperature": 0.7, "reference": "42", "seconds": 1.0,
             "choices": [{"text": "uv", "finish_reason": "stop", "answer": "", "tokens": 2}] * 2}]
    (cache / "m.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (cache / "m.continued.jsonl").write_text(json.dumps({"item": 0, "kind": "greedy", "seed": None, "choice": 0,
                                                         "budget": 768, "text": "de", "finish_reason": "stop",
                                                         "tokens": 2, "answer": "", "seconds": 1.0}) + "\n")
    monkeypatch.setattr(gsm8k_score, "chat_head", lambda config, model: lambda q: f"<{q}>")
    engine = FakeEngine("m", max_model_len=4000)

    def run(*extra: str) -> int:
        parser = argparse.ArgumentParser()
        gsm8k_score.add_arguments(parser)
        return gsm8k_score.main(parser.parse_args(["--url", srv.url, "--model", "m", "--data-dir", str(tmp_path),
                                                   "--cache", str(tmp_path / "c"), "--k", "5", *extra]))

    with serve_fakes({"m": engine}) as srv:
        assert run("--kind", "sample", "--samples", "1") == 0
        got = [json.loads(x) for x in (cache / "m.scored.jsonl").read_text().splitlines()]
        assert [(g["kind"], g["seed"], len(g["lp"])) for g in got] == [("sample", 5, 3)]  # only what was asked
        assert run() == 0
        got = [json.loads(x) for x in (cache / "m.scored.jsonl").read_text().splitlines()]
        assert [(g["kind"], len(g["lp"]), g["k"]) for g in got] == [("sample", 3, 5), ("sample", 2, 5),
                                                                    ("sample", 2, 5), ("greedy", 5, 5)]  # "abcde"
        assert all(c > 0 for g in got for c in g["conf"]) and all(lp <= 0 for g in got for lp in g["lp"])
        sent = engine.opened
        assert run() == 0 and engine.opened == sent  # resumed: nothing left to score


def write_cache(root: Path) -> None:
    """train and test items of one model "m": 4 samples each; the sure sample (confidence 9) is right, the two
    hesitant ones (confidence 2) agree on a wrong answer; the greedy answer is right on even items."""
    for split, n in (("train", 12), ("test", 20)):
        (root / split).mkdir(parents=True)
        rows, scored = [], []
        for i in range(n):
            rows.append({"item": i, "kind": "greedy", "seed": None, "reference": "5", "seconds": 1.0 + i / 100,
                         "choices": [{"text": f"The answer is {5 if i % 2 == 0 else 6}.",
                                      "answer": "5" if i % 2 == 0 else "6", "tokens": 10 + i,
                                      "finish_reason": "stop"}]})
            answers = ["5", "7", "7", "8"]
            rows.append({"item": i, "kind": "sample", "seed": 1, "reference": "5", "seconds": 4.0 + i / 25,
                         "choices": [{"text": a, "answer": a, "tokens": 10 + i, "finish_reason": "stop"}
                                     for a in answers]})
            scored += [{"item": i, "kind": "sample", "seed": 1, "choice": c, "budget": 768, "k": 20,
                        "lp": [-0.1 if c == 0 else -1.0] * 6, "conf": [9.0 if c == 0 else 2.0 + c / 10] * 6}
                       for c in range(4)]
        (root / split / "m.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        (root / split / "m.scored.jsonl").write_text("\n".join(json.dumps(r) for r in scored) + "\n")


def test_train_verifier_and_bench_confidence_on_a_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from chorus.bench import answers_confidence
    from chorus.training import verifier

    write_cache(tmp_path / "c")
    monkeypatch.setenv("CHORUS_HOME", str(tmp_path / "home"))
    parser = argparse.ArgumentParser()
    verifier.add_arguments(parser)
    assert verifier.main(parser.parse_args(["--cache", str(tmp_path / "c"), "--model", "m", "--out", "v"])) == 0
    out = capsys.readouterr().out
    assert "12 items, 48 samples; cross-validated pick 100.0% against majority 0.0%" in out
    assert Verifier.load(tmp_path / "home" / "selectors" / "v").training["items"] == 12
    parser = argparse.ArgumentParser()
    answers_confidence.add_arguments(parser)
    assert answers_confidence.main(parser.parse_args(["--cache", str(tmp_path / "c"), "--model", "m",
                                                      "--quiet-items", "10", "--small", ""])) == 0
    table = capsys.readouterr().out
    assert "test n=20 items whose answers are all scored (choices on train, n=12)" in table
    line = {r.split(" | ")[0].strip("| *"): r for r in table.splitlines() if r.startswith("| ")}
    assert "| 0.0 [" in line["plain majority of 4 (ties: first seen)"]
    assert "| 50.0 [" in line["m greedy"]
    fitted = next(r for r in table.splitlines() if r.startswith("| **fitted on train**"))
    assert "| 100.0 [" in fitted and "| +50.0 [" in fitted and "| +100.0 [" in fitted  # vs greedy, vs majority
    assert "pass@4: some sample right 100.0%" in table
    assert "Confidence over its greedy answer + 4 samples (greedy: true): no scored answers of m" in table
    # a second model whose 8 samples all give the right answer: pooled, a vote over both is right everywhere
    for split, n in (("train", 12), ("test", 20)):
        rows = [{"item": i, "kind": kind, "seed": seed, "reference": "5", "seconds": 2.0 + i / 25,
                 "choices": [{"text": "5", "answer": "5", "tokens": 10 + i, "finish_reason": "stop"}] * count}
                for i in range(n) for kind, seed, count in (("greedy", None, 1), ("sample", 1, 4), ("sample", 2, 4))]
        (tmp_path / "c" / split / "s.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert answers_confidence.main(parser.parse_args(["--cache", str(tmp_path / "c"), "--model", "m",
                                                      "--quiet-items", "10", "--small", "s"])) == 0
    table = capsys.readouterr().out
    both = next(r for r in table.splitlines() if r.startswith("| L 4 samples + S 8 samples: plain majority"))
    assert "| 100.0 [" in both and "| +50.0 [" in both and "| 12.0 |" in both
    # equal cost: against the best one-model row that costs no more (m's verifier picks its sure sample: 100%)
    assert "| +0.0 [+0.0, +0.0] vs L 4 samples: verifier pick (without confidence) | 1 |" in both
    assert "Both models with confidence: 0 of 12 train and 0 of 20 test items have every answer scored" in table
    for split, n in (("train", 12), ("test", 20)):  # every answer scored: the section with confidence
        lines = [{"item": i, "kind": kind, "seed": seed, "choice": c, "budget": 768, "k": 20, "lp": [-0.2] * 6,
                  "conf": [5.0] * 6} for i in range(n) for kind, seed, count in
                 (("greedy", None, 1), ("sample", 1, 4), ("sample", 2, 4)) for c in range(count)]
        (tmp_path / "c" / split / "s.scored.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
        with (tmp_path / "c" / split / "m.scored.jsonl").open("a") as f:
            f.writelines(json.dumps({**r, "kind": "greedy", "seed": None}) + "\n" for r in lines[:n * 9:9])
    assert answers_confidence.main(parser.parse_args(["--cache", str(tmp_path / "c"), "--model", "m",
                                                      "--quiet-items", "10", "--small", "s"])) == 0
    table = capsys.readouterr().out
    assert "Both models together, verifiers with confidence" in table and "test n=20, each verifier" in table


def test_greedy_true_adds_each_members_greedy_answer_as_one_more_vote(client: openai.OpenAI) -> None:
    r = ask(client, {"members": ["doubt", "sharp"], "samples": 2, "greedy": True, "temperature": 0.7})
    trace = r.model_extra["ensemble"]
    assert trace["drawn"] == 6 and [s.get("greedy", False) for s in trace["samples"]][:2] == [True, True]
    assert sum(s.get("greedy", False) for s in trace["samples"]) == 2
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="ensemble", messages=[{"role": "user", "content": "How many?"}], n=4,
                                       extra_body={"ensemble": {"strategy": "answer_vote", "members": ["sharp"],
                                                                "samples": 2, "greedy": True}})
    assert isinstance(err.value.body, dict) and "exceeds the 3 samples" in err.value.body["message"]


# ---- the gate: the greedy answers first, samples only when they are unsure or disagree ----

def gated(client: openai.OpenAI, members: list[str], **ensemble: Any) -> Any:
    body = {"strategy": "answer_vote", "members": members, "samples": 2, "answer": "number", "greedy": True,
            "temperature": 0.7, "trace": True, **ensemble}
    return client.chat.completions.create(model="ensemble", messages=[{"role": "user", "content": "How many?"}],
                                          seed=1, extra_body={"ensemble": body})


@pytest.mark.parametrize("by", [{"gate": -0.5}, {"gate": 10.0, "gate_by": "lowest_window", "window": 4}])
def test_a_confident_greedy_answer_is_the_reply_and_nothing_is_sampled(client: openai.OpenAI,
                                                                       by: dict[str, Any]) -> None:
    r = gated(client, ["sharp"], **by)
    trace = r.model_extra["ensemble"]
    assert trace["gate"]["passed"] and trace["drawn"] == 1 and trace["gate"]["by"] == by.get("gate_by", "mean_logprob")
    assert "no sample drawn" in trace["stopped"]
    assert r.choices[0].message.content == RIGHT  # the greedy text itself
    assert [s.get("greedy", False) for s in trace["samples"]] == [True]


def test_an_unsure_or_disagreeing_greedy_answer_is_sampled(client: openai.OpenAI) -> None:
    unsure = gated(client, ["doubt"], gate=-0.5).model_extra["ensemble"]
    assert not unsure["gate"]["passed"] and unsure["gate"]["confidence"]["doubt"] < -0.5 and unsure["drawn"] == 3
    split = gated(client, ["doubt", "sharp"], gate=-1000.0).model_extra["ensemble"]  # confident enough, not agreed
    assert not split["gate"]["passed"] and split["drawn"] == 6


def test_stop_agree_ends_when_the_first_sample_agrees_with_greedy(client: openai.OpenAI) -> None:
    trace = gated(client, ["sharp"], samples=4, batch=1, stop="agree", temperature=0).model_extra["ensemble"]
    assert trace["drawn"] == 2 and "agree" in trace["stopped"]


@pytest.mark.parametrize(("body", "param"), [
    ({"greedy": False, "gate": -0.5}, "ensemble.gate"),
    ({"gate_by": "tail"}, "ensemble.gate_by"),
    ({"gate": -0.5, "window": 8}, "ensemble.window"),  # mean_logprob reads no window
])
def test_gate_fields_that_would_be_ignored_are_refused(client: openai.OpenAI, body: dict[str, Any],
                                                       param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        gated(client, ["sharp"], **body)
    assert isinstance(err.value.body, dict) and err.value.body["param"] == param, err.value.body


def test_the_online_stop_is_the_same_rule_as_tokens_arrive_and_over_a_whole_trace() -> None:
    conf = [5.0, 5.0, 5.0, 1.0, 1.0, 1.0, 5.0, 5.0]
    assert stop_at(conf, 3, 3.0) == 5  # the window ending at the 5th token (5, 1, 1) is the first below 3
    assert stop_at(conf, 3, 1.0) is None and stop_at([0.0, 0.0], 3, 3.0) is None  # never below; never a whole window
    watch = Watch(3, 3.0)
    assert [watch.add(c) for c in conf[:5]] == [False, False, False, False, True]


def test_trace_stop_stops_unsure_samples_as_they_are_drawn_and_they_do_not_vote(client: openai.OpenAI,
                                                                             fakes: dict[str, FakeEngine]) -> None:
    body = {"strategy": "answer_vote", "members": ["doubt", "sharp"], "samples": 2, "batch": 2, "answer": "number",
            "temperature": 0.7, "trace": True, "trace_stop": 5.0, "window": 4}
    r = client.chat.completions.create(model="ensemble", messages=[{"role": "user", "content": "How many?"}], seed=1,
                                       extra_body={"ensemble": body})
    trace = r.model_extra["ensemble"]
    doubt = [s for s in trace["samples"] if s["member"] == "doubt"]
    assert [(s["finish_reason"], s["tokens"], s["answer"]) for s in doubt] == [("confidence", 4, "")] * 2
    assert trace["trace_stop"] == {"threshold": 5.0, "window": 4, "stopped": 2}
    assert trace["winner"]["answer"] == "42" and r.choices[0].message.content == RIGHT
    # the stopped samples were not generated past their stop: the usage is the tokens each sample had
    assert r.usage.completion_tokens == sum(s["tokens"] for s in trace["samples"])
    assert all(e.active_sessions == 0 for e in fakes.values())  # a stopped stream frees its session


def test_trace_stop_reads_the_window_and_needs_logprobs(client: openai.OpenAI) -> None:
    body = {"strategy": "answer_vote", "members": ["sharp"], "samples": 2, "answer": "number", "trace_stop": 5.0,
            "tail": 8}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="ensemble", messages=[{"role": "user", "content": "How many?"}],
                                       extra_body={"ensemble": body})
    assert isinstance(err.value.body, dict) and err.value.body["param"] == "ensemble.tail"
