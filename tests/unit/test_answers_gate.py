"""`chorus bench gate`'s replay of the served gate over cached answers, and its pre-registration guard."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from chorus.bench.answers import Batch, Item
from chorus.bench.answers_gate import Gate, choose, committed, gated_row, preregister
from chorus.ensembles.answers.confidence import Tokens
from chorus.ensembles.answers.votes import Sample


def sample(answer: str, lp: float, tokens: int = 10) -> Sample:
    return Sample("m", f"The answer is {answer}.", answer, answer, lp, tokens, "stop", Tokens([lp] * tokens,
                                                                                            [5.0] * tokens))


def item(greedy: Sample, samples: list[str]) -> Item:
    batch = [sample(a, -1.0) for a in samples]
    return Item("42", {"m": Batch([greedy.answer], 10.0, 1.0, samples=[greedy])},
                {"m": [Batch(samples, 10.0 * len(samples), 4.0, samples=batch)]})


def test_a_confident_greedy_answer_costs_only_itself() -> None:
    it = item(sample("42", -0.01), ["41", "41", "41", "41"])
    out = gated_row("m", 4, Gate("mean_logprob", -0.05, "none", 4))(it)
    assert out.right and out.samples == 0 and out.tokens == 10.0


def test_an_unsure_one_samples_and_agree_stops_at_the_first_agreeing_sample() -> None:
    agreed = gated_row("m", 4, Gate("mean_logprob", -0.05, "agree", 1))(item(sample("42", -0.5), ["42", "41", "41",
                                                                                                  "41"]))
    assert agreed.samples == 1 and agreed.tokens == 20.0 and agreed.right  # greedy and the first sample agree
    it = item(sample("41", -0.5), ["42", "41", "42", "42"])
    torn = gated_row("m", 4, Gate("mean_logprob", -0.05, "agree", 1))(it)
    assert torn.samples == 4 and torn.tokens == 50.0 and torn.right  # never settled: 42 has 3 of 5
    every = gated_row("m", 4, Gate("mean_logprob", -0.05, "none", 4))(it)
    assert every.samples == 4 and every.right


def test_no_gate_always_samples() -> None:
    it = item(sample("42", -0.01), ["42", "42", "42", "42"])
    out = gated_row("m", 4, Gate("mean_logprob", None, "agree", 1))(it)
    assert out.samples == 1 and out.right


def test_the_test_split_needs_a_committed_preregistration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    subprocess.run(["git", "init", "-q"], check=True)
    pre = Path("pre.json")
    pre.write_text('{"headline": []}')
    with pytest.raises(SystemExit, match="not committed"):
        committed(pre)
    subprocess.run(["git", "add", "pre.json"], check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "pre"], check=True)
    assert committed(pre)
    pre.write_text('{"headline": ["changed after the fact"]}')
    with pytest.raises(SystemExit, match="not committed"):
        committed(pre)


def test_the_preregistered_choice_is_the_cheapest_gated_row_near_the_majority(tmp_path: Path) -> None:
    """Items where the greedy answer is right and sure (the gate skips them) and items where it is wrong and unsure
    (the samples fix them): a gate that lets only the unsure ones sample keeps the majority's accuracy for less."""
    sure = [item(sample("42", -0.01), ["42", "42", "41", "42"]) for _ in range(60)]
    unsure = [item(sample("41", -0.5), ["42", "42", "42", "41"]) for _ in range(40)]
    train = dict(enumerate(sure + unsure))
    gates = [Gate("mean_logprob", None, "none", 4), Gate("mean_logprob", -1.0, "none", 4),
             Gate("mean_logprob", -0.1, "none", 4), Gate("mean_logprob", -0.1, "agree", 1)]
    g, acc, tokens = choose(train, "m", 4, gates)
    assert g == gates[3] and acc == 1.0 and tokens == 22.0  # the unsure ones sample until the vote is settled
    pre = tmp_path / "pre.json"
    preregister(pre, train, "m", 4, gates)
    assert '"gate": -0.1' in pre.read_text() and gates[3].label() in pre.read_text()
    with pytest.raises(SystemExit, match="at least 100"):
        preregister(pre, dict(list(train.items())[:99]), "m", 4, gates)


def test_the_figure_draws_each_split_and_marks_the_headline(tmp_path: Path) -> None:
    from chorus.bench.answers_gate import figure

    train = dict(enumerate([item(sample("42", -0.01), ["42", "42", "41", "42"]),
                            item(sample("41", -0.5), ["42", "42", "42", "41"])]))
    gates = [Gate("mean_logprob", None, "none", 4), Gate("mean_logprob", -0.1, "agree", 1)]
    out = tmp_path / "gate.png"
    figure(out, "m", 4, gates, [("train", train), ("test", train)], {gates[1].label()})
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_the_online_stop_replays_a_low_confidence_sample_cut_and_without_a_vote() -> None:
    from chorus.bench.answers_gate import TRACE_WINDOW, stopped

    low = Sample("m", "The answer is 41.", "41", "41", -1.0, 100, "stop", Tokens([-1.0] * 100, [2.0] * 100))
    s, tokens, seconds = stopped(low, 100.0, 10.0, 3.0)  # every window is below 3: stopped at the first whole one
    assert s.answer == "" and s.finish_reason == "confidence" and tokens == TRACE_WINDOW and seconds == 6.4
    assert stopped(low, 100.0, 10.0, 1.0) == (low, 100.0, 10.0) and stopped(low, 100.0, 10.0, None)[0] is low
    it = item(sample("41", -0.5), ["42", "42", "42", "42"])  # the samples' confidence is 5: never stopped at 3
    row = gated_row("m", 4, Gate("mean_logprob", None, "none", 4, trace_stop=3.0))(it)
    assert row.right and row.samples == 4
