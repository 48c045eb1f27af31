"""The newcomer set (chorus/clients/newcomer.py): strict rules (the false passes a reviewer found fail them; right
answers in any wording pass), no question in the shape of the fallback template's worked exchanges, and a run
against a live gateway over fake engines: scores reported, only an id that errs fails the run."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from chorus.clients import newcomer
from chorus.engines.core.hf_tokenizer import FEW_SHOT_PREAMBLE
from chorus.engines.fake.engine import FakeEngine
from tests.helpers import LiveServer, serve_fakes

RIGHT = {
    "red planet": "Mars is known as the Red Planet.", "eiffel": "France", "spider": "A spider has eight legs.",
    "ocean": "The Pacific Ocean.", "brazil": "Portuguese", "romeo": "William Shakespeare wrote it.",
    "times": "9 times 6 is 54.", "subtract": "25", "add": "23 + 19 = 42", "halve": "Half of 18 is 9.",
    "divide": "25", "double": "70", "fish": "Yes, fish live in water.", "cat flies": "No, cats cannot fly.",
    "even": "No. 7 is odd.", "sunrise": "Yes.", "berlin": "Yes, Berlin is the capital of Germany.",
    "winter": "No, snow is cold.", "colours": "Red, blue, green", "merci": "Merci.", "upper": "CAT",
    "synonym": "One synonym of the word 'big' is 'large'.", "planet": "Jupiter", "dog": "The dog ran across the park.",
    "japan": '{"capital": "Tokyo"}', "legs": '{"legs": 4}', "sky": '{"colour": "blue"}',
    "boolean": '{"is_mammal": true}', "list": '{"numbers": [1, 2, 3]}', "person": '{"name": "Ana", "age": 30}',
}


def question(name: str) -> newcomer.Question:
    return next(q for q in newcomer.QUESTIONS if q.name == name)


def test_thirty_questions_six_of_each_kind_and_right_answers_pass() -> None:
    assert len(newcomer.QUESTIONS) == 30 and set(RIGHT) == {q.name for q in newcomer.QUESTIONS}
    assert all(sum(q.kind == k for q in newcomer.QUESTIONS) == 6 for k in newcomer.KINDS)
    for q in newcomer.QUESTIONS:
        assert q.check(RIGHT[q.name]), q.name


@pytest.mark.parametrize(("rule", "text"), [  # the false passes of the five-question set, each a strict rule here
    (newcomer.says("paris"), "The capital of France is not Paris."),
    (newcomer.equals(12, "What is 7 + 5?"), "7 + 5 = 13 (not 12)."),
    (newcomer.equals(12, "What is 7 + 5?"), "7 + 5 = 13"),
    (newcomer.yes_no("yes"), "Yes, well, the sun is not a star."),
    (newcomer.yes_no("yes"), "Yes and no."),
    (newcomer.sentence_with("sea"), "I cannot write about the sea."),
    (question("japan").check, '{"a": 1}'),
    (question("japan").check, '{"capital": "Kyoto"}'),
    (question("legs").check, '{"legs": "four"}'),
    (question("colours").check, "Red, blue"),
    (question("colours").check, "Red, red, blue"),
    (question("upper").check, "Cat"),
    (question("red planet").check, "Il Coriobella, Italy."),
    (question("eiffel").check, "It is not in France."),
])
def test_wrong_answers_fail(rule: object, text: str) -> None:
    assert callable(rule) and rule(text) is False


def test_no_question_has_the_shape_of_the_worked_exchanges() -> None:
    shapes = ["capital of", "answer in one word", "what is 3 + 4", "answer yes or no", "one sentence about",
              "a json object with a key"]
    preamble = FEW_SHOT_PREAMBLE.lower()
    assert all(s in preamble for s in shapes if s != "capital of") and "capital of italy" in preamble
    for q in newcomer.QUESTIONS:
        text = q.text.lower()
        assert not any(s in text for s in shapes[1:]) and "capital of italy" not in text, q.text
        assert q.text not in FEW_SHOT_PREAMBLE


def good(prompt: str) -> str:
    return next((RIGHT[q.name] for q in newcomer.QUESTIONS if q.text in prompt), "I do not know.")


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    engines = {"good": FakeEngine("good", reply=good), "echo": FakeEngine("echo", reply=lambda p: p[-40:]),
               "broken": FakeEngine("broken", reply=good, fail_after=2)}
    with serve_fakes(engines, [{"name": "both", "strategy": "crowd_vote", "members": ["good", "good"]}]) as srv:
        yield srv


def test_scores_are_reported_and_only_errors_fail_the_run(server: LiveServer, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "scores.json"
    assert newcomer.main(["--url", server.url, "--model", "good", "--model", "both", "--model", "echo",
                          "--json", str(out_file)]) == 0  # echo is wrong everywhere, but it answers: reported
    out = capsys.readouterr().out
    scores = {r["id"]: r["right"] for r in json.loads(out_file.read_text())}
    assert scores["good"] == 30 and scores["both"] == 30 and scores["echo"] < 5
    assert "| echo" in out and "30/30" in out
    assert newcomer.main(["--url", server.url, "--model", "broken"]) == 1  # an engine error fails it
    assert "broken" in capsys.readouterr().err
