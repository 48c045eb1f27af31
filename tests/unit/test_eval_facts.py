"""``chorus eval facts``: the seeded question set, the scoring, and a run over fake engines (one that knows the
capitals, one that knows nothing) with a text-level ensemble of both."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from chorus.clients.eval_facts import CATEGORIES, Fact, evaluate, facts, is_right
from chorus.engines.fake.engine import FakeEngine
from tests.helpers import serve_fakes

CAPITALS = {f.question: f.answers[0] for f in facts(100, 0) if f.category == "capital"}


def test_the_set_is_seeded_and_split_by_category() -> None:
    a, b = facts(200, 0), facts(200, 0)
    assert a == b and facts(200, 1) != a and len({f.id for f in a}) == 200
    counts = {c: sum(f.category == c for f in a) for c in CATEGORIES}
    assert counts == {"capital": 70, "continent": 40, "symbol": 25, "element": 25, "convert": 40}
    by_id = {f.id: f for f in a}
    if "capital-FR" in by_id:
        assert by_id["capital-FR"].answers == ("Paris",)
    assert all(f.answers and all(f.answers) for f in a)
    converts = [f for f in a if f.category == "convert"]
    assert all(int(f.answers[0]) > 0 for f in converts)
    with pytest.raises(SystemExit, match="more questions than the sources have"):
        facts(400, 0)


@pytest.mark.parametrize(("reply", "fact", "right"), [
    ("The capital of France is Paris.", Fact("x", "capital", "q", ("Paris",)), True),
    ("The capital of France is Parisian food.", Fact("x", "capital", "q", ("Paris",)), False),  # whole words only
    ("It is Lyon. Paris is nice.", Fact("x", "capital", "q", ("Paris",)), False),  # the first sentence answers
    ("Australia.", Fact("x", "continent", "q", ("Oceania", "Australia")), True),  # any reference
    ("The answer is: Guatemala City", Fact("x", "capital", "q", ("Guatemala City",)), True),
    ("5 km is 5,000 metres. The answer is 5000.", Fact("x", "convert", "q", ("5000",)), True),
    ("That is 500 metres.", Fact("x", "convert", "q", ("5000",)), False),
])
def test_scoring(reply: str, fact: Fact, right: bool) -> None:
    assert is_right(reply, fact) is right


def knows_capitals(prompt: str) -> str:
    for question, capital in CAPITALS.items():
        if question in prompt:
            return f"The capital is {capital}."
    return "I do not know."


def test_a_run_over_fake_engines() -> None:
    engines = {"knows": FakeEngine("knows", max_model_len=8192, reply=knows_capitals),
               "blank": FakeEngine("blank", max_model_len=8192, script="I do not know.")}
    ensembles = [{"name": "vote", "strategy": "crowd_vote", "members": ["knows", "blank", "knows"],
                  "metric": "word_rouge_l"}]
    with serve_fakes(engines, ensembles) as srv:
        args = argparse.Namespace(n=20, seed=0, max_tokens=40, concurrency=4, timeout=60.0, model=["knows", "blank"],
                                  ensemble=[json.dumps({"label": "vote", "model": "vote"})])
        table, results = asyncio.run(evaluate(args, srv.url + "/v1", {}))
    items = results["items"]
    knows, blank, vote = results["systems"]
    capital = [i for i, f in enumerate(items) if f["category"] == "capital"]
    assert all(knows["right"][i] for i in capital) and sum(knows["right"]) == len(capital)
    assert sum(blank["right"]) == 0 and vote["right"] == knows["right"]  # two of three members agree
    assert vote["calls"] == [3] * 20 and knows["calls"] == [1] * 20
    assert "| knows " in table and "(best model)" in table and "vs knows" in table
