"""Answer-side ensembles: extraction and voting on written tables, the stopping rules on synthetic answer streams,
and the served strategies (answer_vote, consistency_select, the agreement cascade and its artifact) over fake
members whose samples give scripted answers, through the openai SDK (chat, stream, n, Responses API), with their
400s."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from chorus.config import ChorusConfig
from chorus.engines.fake.engine import FakeEngine
from chorus.ensembles.answers.extract import extract_answer
from chorus.ensembles.answers.votes import Sample, agreement, best_sample, beta_confidence, settled, tally
from chorus.ensembles.fitted.artifact import selectors_dir
from chorus.ensembles.fitted.cascade import CascadeThresholds
from chorus.training.cascade import fit_thresholds, member_stats, write_artifact
from tests.helpers import LiveServer, gateway


@pytest.mark.parametrize(("text", "kind", "want"), [
    ("She pays 3 * 4 = 12 dollars. The answer is 12.", "number", "12"),
    ("The total is $1,234.50. The answer is $1,234.50.", "number", "1234.5"),
    ("The answer is 1234.500", "number", "1234.5"),
    ("The answer is: 18 dollars a week", "number", "18"),
    ("It drops to -5 degrees. The answer is -5.", "number", "-5"),
    ("The answer is 0.25", "number", "0.25"),
    ("12 + 30 = 42, so he has 42 left", "number", "42"),  # no phrase: the last number
    ("The answer is 7 apples, not 8.", "number", "7"),  # the phrase: the first number after it
    ("No number at all.", "number", ""),
    # the forms models end with, before the last-number fallback (GSM8K answers of the Qwen2.5-Coder models)
    ("the zookeeper needs \\(\\boxed{1400}\\) bananas to last for 2 months", "number", "1400"),
    ("so \\boxed{1,200} dollars in 3 weeks", "number", "1200"),
    ("the weight is \\(\\boxed{6W_0 + 16}\\) pounds", "number", "16"),  # a box: its content's last number
    ("we add 4 and 5.\n\nFinal Answer: 9 apples in 2 bags", "number", "9"),
    ("Step 1: 3 + 4 = 7\n**Answer:** 7 cats, 2 dogs", "number", "7"),
    ("The answer is 7 ... rechecking: \\boxed{8}", "number", "8"),  # the last form said wins
    ("I think (C) fits. The answer is (B).", "choice", "B"),
    ("Option A is wrong; D", "choice", "D"),
    ("Yes, it does. The answer is no.", "yes_no", "no"),
    ("Yes, because water boils.", "yes_no", "yes"),
    ("The answer is Paris.", "text", "Paris"),
])
def test_extraction_table(text: str, kind: str, want: str) -> None:
    assert extract_answer(text, kind) == want


def S(member: str, answer: str, lp: float | None = None) -> Sample:
    return Sample(member, f"... The answer is {answer}.", answer, mean_logprob=lp)


@pytest.mark.parametrize(("samples", "weights", "winner", "tie"), [
    ([S("a", "3"), S("a", "4"), S("b", "4")], None, "4", None),
    ([S("a", "3", -0.5), S("b", "4", -0.2)], None, "4", "log-probability"),  # a tie: the likelier answer
    ([S("a", "3"), S("b", "4")], None, "3", "first seen"),  # no log-probabilities: the first seen
    ([S("a", "3"), S("b", "4"), S("b", "4")], {"a": 3.0, "b": 1.0}, "3", None),  # weights count
    ([S("a", ""), S("a", ""), S("b", "5")], None, "5", None),  # no answer: no vote
    ([S("a", ""), S("b", "")], None, "", None),
])
def test_voting_table(samples: list[Sample], weights: dict[str, float] | None, winner: str, tie: str | None) -> None:
    t = tally(samples, weights)
    assert (t.winner, t.tie_broken_by) == (winner, tie)
    assert t.drawn == len(samples) and t.votes == sum(bool(s.answer) for s in samples)


def cut(member: str, answer: str) -> Sample:
    return Sample(member, f"... so far {answer}", answer, finish_reason="length")


@pytest.mark.parametrize(("samples", "unfinished", "winner", "abstained"), [
    ([cut("a", "18"), cut("a", "18"), S("a", "7")], "abstain", "7", 2),  # cut samples give way to a finished one
    ([cut("a", "18"), cut("a", "18"), S("a", "7")], "vote", "18", 0),
    ([cut("a", "18"), cut("a", "18"), cut("a", "9")], "abstain", "18", 0),  # none finished: they all vote
    ([cut("a", "18"), S("a", "")], "abstain", "18", 0),  # a finished sample without an answer does not count
])
def test_samples_cut_at_max_tokens_abstain(samples: list[Sample], unfinished: str, winner: str,
                                           abstained: int) -> None:
    t = tally(samples, unfinished=unfinished)  # type: ignore[arg-type]
    assert (t.winner, t.abstained) == (winner, abstained)
    if unfinished == "abstain" and abstained:
        assert agreement(samples, t) == (pytest.approx(1 / 3), "7")  # an abstaining sample counts against


def test_the_reply_is_the_likeliest_sample_of_the_winning_answer() -> None:
    samples = [S("a", "4", -0.9), S("a", "4", -0.1), S("b", "3", 0.0)]
    best = best_sample(samples, tally(samples).winner)
    assert best is samples[1]
    assert agreement(samples) == (pytest.approx(2 / 3), "4")
    assert agreement([S("a", ""), S("a", "4")]) == (0.5, "4")  # no answer counts against agreement
    cut_first = [cut("a", "4"), S("a", "4", -2.0)]
    cut_first[0].mean_logprob = -0.1
    assert best_sample(cut_first, "4") is cut_first[1]  # a finished text before a likelier one cut mid-sentence


@pytest.mark.parametrize(("stream", "total", "rule", "stops_after"), [
    ("aaaaaaaaaaaaaaaa", 16, "beta", 4),  # 4 of 4: P = 0.969 >= 0.95
    ("aaabaaaaaaaaaaaa", 16, "beta", 8),  # 3 to 1 is not settled (0.81); 7 to 1 is
    ("aaaaaaaaaaaaaaaa", 16, "majority", 12),  # a lead of 12 cannot be caught by the 4 left
    ("abababababababab", 16, "beta", 16),  # never settled: every sample
    ("aaaaaaaaaaaaaaaa", 16, "none", 16),
    ("aaaaaaaaaaaaaaaa", 16, "agree", 4),  # the first batch all agree
    ("aaabaaaaaaaaaaaa", 16, "agree", 12),  # once they disagree: the majority rule
])
def test_stopping_rules_on_answer_streams(stream: str, total: int, rule: str, stops_after: int) -> None:
    drawn = 0
    for drawn in range(4, total + 1, 4):  # batches of 4
        t = tally([S("m", a) for a in stream[:drawn]])
        if settled(t, total - drawn, rule)[0]:
            break
    assert drawn == stops_after


def test_agree_stops_at_two_agreeing_votes() -> None:
    assert settled(tally([S("m", "a"), S("m", "a")]), 3, "agree")[0]
    assert not settled(tally([S("m", "a")]), 3, "agree")[0]  # one vote is no agreement
    assert not settled(tally([S("m", "a"), S("m", "b")]), 3, "agree")[0]


def test_beta_confidence() -> None:
    assert beta_confidence(4, 0) == pytest.approx(1 - 0.5 ** 5)
    assert beta_confidence(3, 1) == pytest.approx(0.8125)
    assert beta_confidence(2, 2) == pytest.approx(0.5)


# ---- served, over fake members ----

RIGHT, WRONG, OTHER = "Step by step. The answer is 42.", "Hmm. The answer is 41.", "So the answer is 7."
LONG = "Nine and nine is 18, and then we still have to count the rest of the apples one by one. The answer is 5."


@pytest.fixture(scope="module")
def fakes() -> dict[str, FakeEngine]:
    return {
        # four samples of "sure": 42, 42, 42, 41 (cycling); of "torn": 7, 41, 7, 41; of "mute": no answer
        "sure": FakeEngine("sure", replies=[RIGHT, RIGHT, RIGHT, WRONG], sharpness=100.0, max_model_len=4000),
        "torn": FakeEngine("torn", replies=[OTHER, WRONG], sharpness=100.0, max_model_len=4000),
        "mute": FakeEngine("mute", replies=["I cannot say."], sharpness=100.0, max_model_len=4000),
        # a long chain of thought that max_tokens cuts after "18", twice, then a short finished answer
        "long": FakeEngine("long", replies=[LONG, LONG, OTHER], sharpness=100.0, max_model_len=4000),
    }


@pytest.fixture(scope="module")
def server(fakes: dict[str, FakeEngine]) -> Iterator[LiveServer]:
    config = {"models": [{"name": n, "engine": "fake"} for n in fakes],
              "ensembles": [{"name": "sc", "strategy": "answer_vote", "members": ["sure"], "samples": 4,
                             "answer": "number"}]}
    with gateway(ChorusConfig.model_validate(config), engines=dict(fakes), timeout=120) as srv:
        yield srv
    assert all(e.active_sessions == 0 for e in fakes.values())


@pytest.fixture
def client(server: LiveServer, fakes: dict[str, FakeEngine]) -> openai.OpenAI:
    for f in fakes.values():
        f.opened = 0  # each test starts each fake at its first reply
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def ask(client: openai.OpenAI, ensemble: dict[str, Any], model: str = "ensemble", **kw: Any) -> Any:
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "How many apples are left?"}],
        extra_body={"ensemble": {"trace": True, **ensemble}}, **kw)


def test_self_consistency_of_one_member_votes_on_answers(client: openai.OpenAI) -> None:
    r = ask(client, {}, model="sc")
    trace = r.model_extra["ensemble"]
    assert r.choices[0].message.content == RIGHT  # the whole text of a sample that gives the winning answer
    assert trace["histogram"] == {"42": 3, "41": 1} and trace["drawn"] == 4
    assert [s["answer"] for s in trace["samples"]] == ["42", "42", "42", "41"]
    assert trace["winner"]["answer"] == "42" and "3 of 4 votes" in trace["reason"]
    assert trace["answer_type"] == "number" and trace["usage"]["calls"] == 1  # one request of n = 4


@pytest.mark.parametrize(("unfinished", "answer", "abstained"), [("abstain", "7", 2), ("vote", "18", 0)])
def test_samples_cut_at_max_tokens_abstain_when_served(client: openai.OpenAI, unfinished: str, answer: str,
                                                       abstained: int) -> None:
    r = ask(client, {"strategy": "answer_vote", "members": ["long"], "samples": 3, "batch": 3, "answer": "number",
                     "unfinished": unfinished}, max_tokens=40)
    trace = r.model_extra["ensemble"]
    assert [s["finish_reason"] for s in trace["samples"]] == ["length", "length", "stop"]
    assert trace["winner"]["answer"] == answer and trace["abstained"] == abstained


@pytest.mark.parametrize(("unfinished", "winner", "answer", "asked"), [
    ("abstain", "torn", "7", ["long", "sure"]), ("vote", "long", "18", ["long"])])
def test_cut_samples_count_against_agreement_in_selection_and_the_cascade(
        client: openai.OpenAI, unfinished: str, winner: str, answer: str, asked: list[str]) -> None:
    """"long" gives 18 twice (both cut) and 7 once: abstaining, its agreement is 1/3 and "torn" (7, 41, 7: 2/3)
    is chosen, and the cascade escalates past it at 0.6; voting, 18 agrees 2/3 (a tie that member order breaks)."""
    r = ask(client, {"strategy": "consistency_select", "members": ["long", "torn"], "samples": 3, "batch": 3,
                     "answer": "number", "unfinished": unfinished}, max_tokens=40)
    assert r.model_extra["ensemble"]["winner"] == {"member": winner, "answer": "18" if winner == "long" else "7"}
    # "long" has opened 3 sessions: a cycle of its 3 replies, so the cascade sees the same samples
    c = ask(client, {"strategy": "cascade", "members": ["long", "sure"], "confidence": "agreement", "samples": 3,
                     "threshold": 0.6, "answer": "number", "unfinished": unfinished}, max_tokens=40)
    steps = c.model_extra["ensemble"]["steps"]
    assert [s["member"] for s in steps] == asked
    assert "18" in c.choices[0].message.content if answer == "18" else c.choices[0].message.content == RIGHT


def test_an_unknown_unfinished_rule_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, {"strategy": "answer_vote", "members": ["sure"], "unfinished": "sometimes"})
    assert "unfinished" in str(err.value)


def test_two_members_vote_together_and_n_gives_distinct_answers(client: openai.OpenAI) -> None:
    r = ask(client, {"strategy": "answer_vote", "members": ["torn", "sure"], "samples": 4}, n=3)
    trace = r.model_extra["ensemble"]
    assert trace["histogram"] == {"41": 3, "42": 3, "7": 2}
    assert trace["answer_type"] == "number" and trace["answer_rule"] == "'how many' / 'how much'"
    # 41 and 42 tie at 3 votes; the fakes' samples are all certain (mean log-probability 0), so the log-probability
    # rule cannot part them and the first seen wins: torn's 41 (sample 2) before sure's 42 (sample 5). The table
    # test above parts a tie by log-probability. n = 3: each answer's best sample
    assert [s["mean_logprob"] for s in trace["samples"]] == [0.0] * 8
    assert trace["winner"] == {"answer": "41", "member": "torn"}
    assert trace["reason"] == "answer '41' has 3 of 8 votes (tie broken by first seen)"
    assert {c.message.content for c in r.choices} == {RIGHT, WRONG, OTHER}
    assert trace["histogram"][trace["winner"]["answer"]] == 3


def test_adaptive_sampling_stops_when_settled(client: openai.OpenAI, fakes: dict[str, FakeEngine]) -> None:
    fakes["sure"].replies = [RIGHT]
    try:
        r = ask(client, {"strategy": "answer_vote", "members": ["sure"], "samples": 16, "batch": 4, "stop": "beta"})
    finally:
        fakes["sure"].replies = [RIGHT, RIGHT, RIGHT, WRONG]
    trace = r.model_extra["ensemble"]
    assert trace["drawn"] == 4 and trace["stopped"].startswith("Beta rule")
    fixed = ask(client, {"strategy": "answer_vote", "members": ["torn"], "samples": 8, "batch": 4, "stop": "beta"})
    assert fixed.model_extra["ensemble"]["drawn"] == 8  # 7 and 41 stay tied: every sample


def test_answer_vote_streams_and_serves_the_responses_api(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="sc", messages=[{"role": "user", "content": "How many apples are left?"}], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == RIGHT
    resp = client.responses.create(model="sc", input="How many apples are left?")
    assert resp.output_text == RIGHT


def test_no_extractable_answer_returns_a_sample(client: openai.OpenAI) -> None:
    r = ask(client, {"strategy": "answer_vote", "members": ["mute"], "samples": 2})
    assert r.choices[0].message.content == "I cannot say."
    assert "no sample gave an extractable answer" in r.model_extra["ensemble"]["reason"]


def test_consistency_select_answers_with_the_member_that_agrees_with_itself(client: openai.OpenAI) -> None:
    r = ask(client, {"strategy": "consistency_select", "members": ["torn", "sure"], "samples": 4})
    trace = r.model_extra["ensemble"]
    assert trace["winner"] == {"member": "sure", "answer": "42"} and r.choices[0].message.content == RIGHT
    assert trace["members"]["sure"]["agreement"] == 0.75 and trace["members"]["torn"]["agreement"] == 0.5
    tie = ask(client, {"strategy": "consistency_select", "members": ["torn", "torn"], "samples": 2,
                       "accuracy": [0.2, 0.6]})
    assert tie.model_extra["ensemble"]["winner"]["member"] == "torn#2"
    assert "prior accuracy" in tie.model_extra["ensemble"]["reason"]


@pytest.mark.parametrize(("unfinished", "share", "right"), [("abstain", 1 / 3, True), ("vote", 2 / 3, False)])
def test_the_cascade_fit_reads_cut_answers_as_the_served_rule_does(unfinished: str, share: float,
                                                                    right: bool) -> None:
    rows = [{"members": [["7", "18", "18"]], "finished": [[True, False, False]], "reference": "7"}]
    assert member_stats(rows, unfinished=unfinished) == [[(pytest.approx(share), right)]]  # type: ignore[arg-type]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A CHORUS_HOME of the test's own: fitted artifacts are read from its selectors/ folder."""
    monkeypatch.setenv("CHORUS_HOME", str(tmp_path))
    return tmp_path


def test_agreement_cascade_thresholds_round_trip_through_the_artifact(client: openai.OpenAI, home: Path) -> None:
    # train rows: the small model's samples, the large one's, the reference; the small one is right when sure
    rows = [{"members": [["42"] * 4, ["42"] * 4], "reference": "42"},
            {"members": [["1", "2", "3", "1"], ["5"] * 4], "reference": "5"},
            {"members": [["9", "9", "9", "8"], ["9"] * 4], "reference": "9"}]
    fit = fit_thresholds(rows, target=1.0)
    assert fit.thresholds == [0.75] and fit.accuracy == 1.0 and fit.escalated == pytest.approx(1 / 3)
    path = write_artifact(selectors_dir() / "round-trip", ["sure", "torn"], fit, answer="number", samples=4,
                          source="test rows")
    assert json.loads(path.read_text())["thresholds"] == [0.75]
    r = ask(client, {"strategy": "cascade", "members": ["sure", "torn"], "confidence": "agreement",
                     "answer": "number", "samples": 4, "artifact": "round-trip"})
    steps = r.model_extra["ensemble"]["steps"]
    assert steps[0]["member"] == "sure" and steps[0]["decision"].startswith("accepted: confidence 0.7500 >= 0.75")
    assert r.choices[0].message.content == RIGHT
    low = ask(client, {"strategy": "cascade", "members": ["torn", "sure"], "confidence": "agreement",
                       "answer": "number", "samples": 4, "threshold": 0.75})
    assert [s["member"] for s in low.model_extra["ensemble"]["steps"]] == ["torn", "sure"]


@pytest.mark.parametrize(("ensemble", "param", "words"), [
    ({"strategy": "answer_vote", "members": ["sure"], "samples": 65}, "ensemble.samples", "less than or equal"),
    ({"strategy": "answer_vote", "members": ["sure"], "samples": 0}, "ensemble.samples", "greater than or equal"),
    ({"strategy": "answer_vote", "members": ["sure"], "stop": "sometimes"}, "ensemble.stop", "none, majority"),
    ({"strategy": "answer_vote", "members": ["sure"], "samples": 4, "batch": 4, "stop": "beta"}, "ensemble.stop",
     "more than one batch"),
    ({"strategy": "answer_vote", "members": ["sure", "torn"], "weights": [1]}, "ensemble.weights", "2 non-negative"),
    ({"strategy": "consistency_select", "members": ["sure", "torn"], "accuracy": [0.5, 1.5]}, "ensemble.accuracy",
     "in [0, 1]"),
    ({"strategy": "cascade", "members": ["sure", "torn"], "confidence": "agreement", "threshold": 1.5},
     "ensemble.threshold", "(0, 1]"),
    ({"strategy": "cascade", "members": ["sure", "torn"], "confidence": "agreement"}, "ensemble.threshold",
     "exactly one of"),
])
def test_bad_answer_side_ensembles_are_400s_naming_the_field(client: openai.OpenAI, ensemble: dict[str, Any],
                                                             param: str, words: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, ensemble)
    body = err.value.body
    assert isinstance(body, dict) and body["param"] == param and words in body["message"]


def test_an_artifact_for_other_members_is_a_400(client: openai.OpenAI, home: Path) -> None:
    CascadeThresholds(members=["big", "small"], thresholds=[0.5]).save(selectors_dir() / "other")
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, {"strategy": "cascade", "members": ["sure", "torn"], "confidence": "agreement",
                     "artifact": "other"})
    body = err.value.body
    assert isinstance(body, dict) and body["param"] == "ensemble.members" and "trained on members" in body["message"]


@pytest.mark.parametrize(("name", "words"), [
    ("../../etc/passwd", "must name an artifact inside"), ("/etc/hostname", "must name an artifact inside"),
    ("nowhere", "No cascade artifact 'nowhere'"), ("broken", "not a chorus chorus-agreement-cascade artifact")])
def test_a_cascade_artifact_is_read_only_inside_the_selectors_folder(client: openai.OpenAI, home: Path, name: str,
                                                                      words: str) -> None:
    """A request names an artifact; it cannot make the server open (or probe for) a file anywhere else."""
    (selectors_dir() / "broken").mkdir(parents=True, exist_ok=True)
    (selectors_dir() / "broken" / "cascade.json").write_text(json.dumps({"members": ["sure", "torn"],
                                                                          "thresholds": [0.5]}))
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, {"strategy": "cascade", "members": ["sure", "torn"], "confidence": "agreement",
                     "artifact": name})
    body = err.value.body
    assert isinstance(body, dict) and body["param"] == "ensemble.artifact" and words in body["message"]


def test_an_artifact_fitted_with_the_other_cut_sample_rule_is_a_400(client: openai.OpenAI, home: Path,
                                                                       tmp_path: Path) -> None:
    """`chorus train cascade --unfinished vote` writes its rule; a cascade that abstains cannot use its thresholds,
    and one that votes can."""
    from chorus.training import cascade as train

    cache = tmp_path / "cache"
    (cache / "train").mkdir(parents=True)
    for m, answers in (("sure", ["42"] * 4), ("torn", ["7", "41", "7", "41"])):
        (cache / "train" / f"{m}.jsonl").write_text(json.dumps({
            "item": 0, "kind": "sample", "seed": 1, "reference": "42",
            "choices": [{"answer": a, "finish_reason": "length" if i else "stop"} for i, a in enumerate(answers)]}))
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    assert train.main(parser.parse_args(["--member", "sure", "--member", "torn", "--cache", str(cache),
                                         "--out", "voted", "--unfinished", "vote"])) == 0
    assert json.loads((selectors_dir() / "voted" / "cascade.json").read_text())["unfinished"] == "vote"
    spec = {"strategy": "cascade", "members": ["sure", "torn"], "confidence": "agreement", "answer": "number",
            "samples": 4, "artifact": "voted"}
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, spec)
    body = err.value.body
    assert isinstance(body, dict) and body["param"] == "ensemble.unfinished" and "unfinished: vote" in body["message"]
    assert ask(client, {**spec, "unfinished": "vote"}).model_extra["ensemble"]["thresholds"] == [1.0]


def test_n_above_the_samples_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, {"strategy": "answer_vote", "members": ["sure"], "samples": 2}, n=3)
    body = err.value.body
    assert isinstance(body, dict) and body["param"] == "n"


def test_bench_answers_replays_the_strategies_on_a_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`chorus bench answers` over a written cache: the small model is right when its samples agree; the large
    one always; every row is reported on test with its cost, the cascade's threshold fitted on train."""
    import argparse

    from chorus.bench import answers

    def rows(model: str, split: str) -> list[dict[str, Any]]:
        out = []
        for i in range(12):
            sure = i % 3 != 0  # the small model agrees with itself on 2 items of 3, and is right then
            small = ["5"] * 4 if sure else ["1", "2", "1", "3"]
            answers_ = (small if model == "s" else ["5"] * 4)
            out += [{"item": i, "kind": "greedy", "seed": None, "reference": "5", "seconds": 1.0,
                     "choices": [{"answer": answers_[0], "tokens": 10}]},
                    {"item": i, "kind": "sample", "seed": 1, "reference": "5", "seconds": 2.0 if model == "s" else 6.0,
                     "choices": [{"answer": a, "tokens": 10} for a in answers_]}]
        return out

    for split in ("train", "test"):
        for model in ("s", "l"):
            (tmp_path / split).mkdir(exist_ok=True)
            (tmp_path / split / f"{model}.jsonl").write_text("\n".join(json.dumps(r) for r in rows(model, split)))
    parser = argparse.ArgumentParser()
    answers.add_arguments(parser)
    args = parser.parse_args(["--cache", str(tmp_path), "--small", "s", "--large", "l", "--k-small", "4",
                              "--figure-data", str(tmp_path / "fig.json"), "--seconds", "measured"])
    assert answers.main(args) == 0
    table = capsys.readouterr().out
    assert "n=12 items" in table and "best member on train: l greedy" in table
    fitted = next(line for line in table.splitlines() if "tau fitted" in line)
    assert "(1;" in fitted and "| 100.0 [" in fitted and "| 33% |" in fitted  # escalates only the unsure third
    figure = json.loads((tmp_path / "fig.json").read_text())
    assert figure["n"] == 12 and figure["seconds"] == "measured"
    # the cascade's curve: never escalating, the small model alone (2 in 3 right); always, the large one (all right)
    assert (figure["cascade_curve"][0]["share"], figure["cascade_curve"][0]["sc"]) == (0.0, pytest.approx(2 / 3))
    assert (figure["cascade_curve"][-1]["share"], figure["cascade_curve"][-1]["sc"]) == (1.0, 1.0)
    assert "- s k=4: +0.0 [+0.0, +0.0], McNemar p = 1" in table  # s's samples say what its greedy answer says


def test_bench_answers_models_seconds_from_tokens_on_quiet_items() -> None:
    """`--seconds modeled`: a + b * tokens per choice, fitted per model and kind on the quiet items, charged to
    every request; the note gives how much longer the others took (a machine shared with other work)."""
    from chorus.bench.answers import Batch, Item, model_seconds

    def item(i: int, slow: float) -> Item:
        tokens = 100 + 10 * i
        return Item("1", greedy={"m": Batch(["1"], tokens, slow * (0.5 + 0.02 * tokens), 0.0)},
                    samples={"m": [Batch(["1"] * 4, 4 * tokens, slow * (6 + 0.04 * tokens), 0.0)]})

    items = {i: item(i, 1.0 if i < 5 else 2.0) for i in range(10)}
    for it in items.values():  # as cached: the measured seconds
        for b in [*it.greedy.values(), *it.samples["m"]]:
            b.measured = b.seconds
    notes = model_seconds({i: it for i, it in items.items() if i < 5}, [items], ["m"])
    assert items[9].greedy["m"].seconds == pytest.approx(0.5 + 0.02 * 190)  # the quiet machine's seconds
    assert items[9].samples["m"][0].seconds == pytest.approx(6 + 0.04 * 190)
    assert "0.50 s + 20.0 ms/token, fitted on 5 quiet requests" in notes[0] and "took 2.00x the modeled seconds (median)" in notes[0]
    with pytest.raises(SystemExit, match="quiet greedy requests"):
        model_seconds({}, [items], ["m"])


def test_bench_answers_fits_a_vote_weight_on_train() -> None:
    """The larger member's weight in the vote: the smallest that gets the best train accuracy."""
    from chorus.bench.answers import Batch, Item, fit_weight, vote

    def item(small: list[str], large: list[str]) -> Item:
        return Item("5", samples={"s": [Batch(small, 40, 1.0)], "l": [Batch(large, 40, 1.0)]})

    # "3" has three small votes and one large, "5" one small and two large: at weight w, 3 + w against 1 + 2w
    train = {0: item(["3", "3", "3", "5"], ["5", "5", "3", "4"])}
    ks = {"l": 4, "s": 4}
    assert fit_weight(train, ks, "l") == 2.0  # at 2 they tie (5 to 5) and the large member's "5", seen first, wins
    assert vote(ks)(train[0]).right is False and vote(ks, {"l": 2.0})(train[0]).right is True


def test_eval_gsm8k_caches_answers_and_resumes(tmp_path: Path) -> None:
    """`chorus eval gsm8k` over a live gateway: greedy and seeded samples per item into the cache, GSM8K rows as
    chat turns and `--items` rows (the addition set's shape) as completions stopped at the line's end; a rerun
    sends only what is missing."""
    import argparse

    from chorus.clients import eval_gsm8k
    from tests.helpers import serve_fakes

    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text("\n".join(json.dumps({"question": f"Q{i}?", "answer": "x\n#### 42"})
                                                          for i in range(2)) + "\n")
    (tmp_path / "add.jsonl").write_text(json.dumps({"prompt": "1 + 1 = 2\n40 + 2 =", "answer": "42"}) + "\n")
    engine = FakeEngine("m", script=" 42 and more\nnext line", sharpness=100.0, max_model_len=4000)

    def run(*extra: str) -> int:
        parser = argparse.ArgumentParser()
        eval_gsm8k.add_arguments(parser)
        return eval_gsm8k.main(parser.parse_args(
            ["--url", srv.url, "--model", "m", "--data-dir", str(tmp_path), "--count", "2", "--k", "4",
             "--max-tokens", "30", *extra]))

    with serve_fakes({"m": engine}) as srv:
        assert run("--cache", str(tmp_path / "c")) == 0
        rows = [json.loads(x) for x in (tmp_path / "c" / "test" / "m.jsonl").read_text().splitlines()]
        assert [(r["item"], r["kind"], r["seed"]) for r in rows] == [
            (0, "greedy", None), (0, "sample", 1_000_000), (1, "greedy", None), (1, "sample", 1_001_000)]
        assert rows[1]["reference"] == "42" and len(rows[1]["choices"]) == 4
        assert rows[0]["choices"][0]["answer"] == "42"  # the chat reply's last number
        sent = engine.opened  # the engine's sessions: one per greedy answer, n per sampling request
        assert run("--cache", str(tmp_path / "c")) == 0  # resumed: nothing missing, nothing sent
        assert engine.opened == sent and len((tmp_path / "c" / "test" / "m.jsonl").read_text().splitlines()) == 4
        assert run("--cache", str(tmp_path / "c"), "--k", "8") == 0  # extended: only the new samples are sent
        more = [json.loads(x) for x in (tmp_path / "c" / "test" / "m.jsonl").read_text().splitlines()][4:]
        assert [(r["item"], r["seed"]) for r in more] == [(0, 1_000_004), (1, 1_001_004)] and engine.opened > sent
        assert run("--cache", str(tmp_path / "a"), "--items", str(tmp_path / "add.jsonl")) == 0
        add = [json.loads(x) for x in (tmp_path / "a" / "test" / "m.jsonl").read_text().splitlines()]
        assert add[0]["choices"][0]["text"] == " 42 and more"  # a completion, stopped at the line's end
        assert add[0]["choices"][0]["answer"] == "42" and add[0]["reference"] == "42"


def test_a_member_that_relays_no_logprobs_votes_without_them() -> None:
    """A member whose generations carry no token log-probabilities (an engine that refuses a request for them): an
    answer vote over it asks for none, and its tie-break falls to the first seen."""
    from chorus.engines.core.base import Generation, GenerationRequest
    from chorus.errors import InvalidRequest
    from tests.helpers import serve_fakes

    class NoLogprobs(FakeEngine):
        relays_logprobs = False

        async def generate(self, request: GenerationRequest) -> Generation:
            if request.params.logprobs:
                raise InvalidRequest("logprobs are not relayed from this model.", param="logprobs")
            return await super().generate(request)

    remote = NoLogprobs("remote", replies=[RIGHT, RIGHT, WRONG], sharpness=100.0, max_model_len=4000)
    with serve_fakes({"remote": remote}) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        r = ask(c, {"strategy": "answer_vote", "members": ["remote"], "samples": 3}, model="remote")
        trace = r.model_extra["ensemble"]
        assert trace["winner"]["answer"] == "42" and trace["histogram"] == {"42": 2, "41": 1}
        assert all(s["mean_logprob"] is None for s in trace["samples"])


def test_eval_gsm8k_continue_finishes_cut_answers_once(tmp_path: Path) -> None:
    """`chorus eval gsm8k-continue`: each cut answer of the cache is continued from its partial text (the assistant's
    prefix, continue_final_message) to the budget, once; a rerun sends nothing."""
    import argparse

    from chorus.clients import eval_gsm8k_continue
    from tests.helpers import serve_fakes

    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text(json.dumps({"question": "Q0?", "answer": "x\n#### 42"}) + "\n")
    cache = tmp_path / "c" / "test"
    cache.mkdir(parents=True)
    row = {"item": 0, "kind": "greedy", "seed": None, "temperature": 0.0, "max_tokens": 4, "reference": "42",
           "choices": [{"text": "abc", "finish_reason": "length", "answer": "", "tokens": 4}]}
    (cache / "m.jsonl").write_text(json.dumps(row) + "\n")
    engine = FakeEngine("m", max_model_len=4000)  # writes the characters after the prompt's last one

    def run() -> int:
        parser = argparse.ArgumentParser()
        eval_gsm8k_continue.add_arguments(parser)
        return eval_gsm8k_continue.main(parser.parse_args(
            ["--url", srv.url, "--model", "m", "--data-dir", str(tmp_path), "--cache", str(tmp_path / "c"),
             "--budget", "10"]))

    with serve_fakes({"m": engine}) as srv:
        assert run() == 0
        rows = [json.loads(x) for x in (cache / "m.continued.jsonl").read_text().splitlines()]
        assert len(rows) == 1 and rows[0]["choice"] == 0 and rows[0]["tokens"] == 6  # 10 - the 4 drawn
        assert rows[0]["text"] == "defghi"  # the fake goes on from the partial answer's last character
        sent = engine.opened
        assert run() == 0 and engine.opened == sent  # resumed: nothing left to continue
