"""The pieces strategies are made of: similarity metrics, answer extraction, EoT topologies, as case tables."""

from __future__ import annotations

import random

import numpy as np
import pytest
from rouge_score import rouge_scorer

from chorus.ensembles.answers.extract import compile_pattern, extract_answer
from chorus.ensembles.similarity import char_rouge_l, crowd_scores, word_rouge_l
from chorus.ensembles.strategies.crowd_vote import vote
from chorus.ensembles.strategies.exchange_of_thought import agreed, confidence, majority, visibility


def texts(seed: int, n: int = 12) -> list[str]:
    rng = random.Random(seed)
    words = "The cat sat on a mat; dog ran far-away QUICKLY 42 it's Don't e-mail 3.14 über naïve".split()
    out = [" ".join(rng.choice(words) for _ in range(rng.randint(0, 40))) for _ in range(n)]
    return [*out, "", "!!! ???", "Cat cat CAT"]


@pytest.mark.parametrize("seed", range(5))
def test_word_rouge_l_equals_the_rouge_score_package(seed: int) -> None:
    ts = texts(seed)
    scorer = rouge_scorer.RougeScorer(["rougeL"])
    ours = word_rouge_l(ts)
    for i, a in enumerate(ts):
        for j, b in enumerate(ts):
            assert abs(ours[i, j] - scorer.score(b, a)["rougeL"].fmeasure) <= 1e-9, (a, b)


def lcs(a: str, b: str) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


@pytest.mark.parametrize("seed", range(3))
def test_char_rouge_l_is_lcs_f_over_lowercased_characters(seed: int) -> None:
    ts = [t[:60] for t in texts(seed, 6)]
    ours = char_rouge_l(ts)
    for i, a in enumerate(ts):
        for j, b in enumerate(ts):
            a_, b_ = a.lower(), b.lower()
            if not a_ or not b_:
                assert ours[i, j] == 0.0
                continue
            n = lcs(a_, b_)
            p, r = n / len(a_), n / len(b_)
            assert ours[i, j] == pytest.approx(0.0 if n == 0 else 2 * p * r / (p + r), abs=1e-12)


def test_crowd_scores_and_vote() -> None:
    sim = np.array([[1.0, 0.2, 0.3], [0.2, 1.0, 0.9], [0.3, 0.9, 1.0]])
    assert crowd_scores(sim).tolist() == pytest.approx([0.5, 1.1, 1.2])
    winner, q, _per, matrix = vote(["a b c", "a b d", "a b d"], {"word_rouge_l": 1.0})
    assert winner == 1 and q[1] == q[2]  # a tie goes to the lowest index
    # the matrix the trace carries: weighted similarities whose off-diagonal row sums are the scores
    assert crowd_scores(matrix).tolist() == pytest.approx(q.tolist())
    _w, q2, _p, m2 = vote(["a b c", "a b d"], {"word_rouge_l": 0.5, "char_rouge_l": 0.5})
    assert m2[0, 1] == pytest.approx(0.5 * word_rouge_l(["a b c", "a b d"])[0, 1] + 0.5 * char_rouge_l(
        ["a b c", "a b d"])[0, 1]) and crowd_scores(m2).tolist() == pytest.approx(q2.tolist())


@pytest.mark.parametrize(("text", "kind", "want"), [
    ("6*7 = 42. The answer is 42.", "number", "42"),
    ("The answer is 1,234 apples, not 5", "number", "1234"),
    ("first 3 then 4 and finally 5", "number", "5"),
    ("The answer is -2.5.", "number", "-2.5"),
    ("The answer is 18.0", "number", "18"),
    ("the answer is: $18. Then the answer is 20", "number", "20"),
    ("no numbers here", "number", ""),
    ("I think (B) fits. The answer is (C).", "choice", "C"),
    ("Options A or D; D is right", "choice", "D"),
    ("nothing", "choice", ""),
])
def test_answer_extraction(text: str, kind: str, want: str) -> None:
    assert extract_answer(text, kind) == want


def test_answer_pattern() -> None:
    pat = compile_pattern(r"final: (\w+)")
    assert extract_answer("final: x ... final: yes", pattern=pat) == "yes"
    assert extract_answer("nothing", pattern=pat) == ""
    with pytest.raises(ValueError, match="regular expression"):
        compile_pattern("(")


@pytest.mark.parametrize(("topology", "want"), [  # the EoT paper's table for A, B, C
    ("memory", [[0, 1, 1], [1, 0, 1], [1, 1, 0]]),
    ("report", [[0, 1, 1], [1, 0, 0], [1, 0, 0]]),
    ("relay", [[0, 1, 0], [0, 0, 1], [1, 0, 0]]),
    ("debate", [[0, 1, 1], [0, 0, 1], [0, 1, 0]]),
])
def test_topologies_for_three(topology: str, want: list[list[int]]) -> None:
    assert [[int(x) for x in row] for row in visibility(topology, 3)] == want


def test_topologies_generalise() -> None:
    relay = visibility("relay", 5)
    assert [row.index(True) for row in relay] == [1, 2, 3, 4, 0]
    assert all(not visibility(t, 4)[i][i] for t in ("memory", "report", "relay", "debate") for i in range(4))


def test_confidence_agreement_majority() -> None:
    assert confidence(["42"]) is None
    assert confidence(["42", "7"]) == 0.5
    assert confidence(["42", "7", "42"]) == pytest.approx(2 / 3)
    assert confidence(["", ""]) == 0.0
    assert agreed(["1", "1"]) and not agreed(["1", ""]) and not agreed(["", ""])
    assert majority(["7", "42", "42", ""]) == "42"
    assert majority(["7", "42"]) == "7"  # ties: the earliest agent
    assert majority(["", ""]) == ""
