"""The newcomer set (chorus/clients/newcomer.py): its tolerant rules, and a run against a live gateway over fake
engines, one that answers sensibly and one that repeats the question, as a base model chatting does."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from chorus.clients import newcomer
from chorus.engines.fake.engine import FakeEngine
from tests.helpers import LiveServer, serve_fakes

ANSWERS = {"capital": "The capital of France is Paris.", "7 + 5": "12", "sun": "Yes, the sun is a star.",
           "sea": "The sea is deep, blue and full of fish.", "JSON": '{"colour": "blue"}'}


def good(prompt: str) -> str:
    return next((a for key, a in ANSWERS.items() if key in prompt), "I do not know.")


def echo(prompt: str) -> str:
    return prompt.split("user")[-1][:60]


@pytest.mark.parametrize(("name", "text", "ok"), [
    ("capital", "Paris.", True), ("capital", "PARIS", True), ("capital", "Lyon", False),
    ("sum", "7 + 5 = 12", True), ("sum", "1,2", False), ("sum", "twelve", False),
    ("yes/no", "Yes.", True), ("yes/no", "Yes and no.", False), ("yes/no", "No", False),
    ("sentence", "Waves roll over the blue sea.", True), ("sentence", "Write one sentence about the sea.", False),
    ("sentence", "Sea.", False),
    ("json", '{"colour": "red"}', True), ("json", "[1]", False), ("json", "{}", False), ("json", "red", False),
])
def test_the_rules_accept_any_wording_around_a_sensible_answer(name: str, text: str, ok: bool) -> None:
    question = next(q for q in newcomer.QUESTIONS if q.name == name)
    assert question.check(text) is ok


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    engines = {"good": FakeEngine("good", reply=good), "echo": FakeEngine("echo", reply=echo),
               "slow": FakeEngine("slow", reply=good, delay=0.05)}
    with serve_fakes(engines, [{"name": "both", "strategy": "crowd_vote", "members": ["good", "good"]}]) as srv:
        yield srv


def test_every_chat_id_is_asked_and_a_failing_one_fails_the_run(server: LiveServer,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert newcomer.main(["--url", server.url, "--model", "good", "--model", "both"]) == 0
    out = capsys.readouterr().out
    assert out.count(" 5/5 ") == 2 and "newcomer: 2 ids answered" in out
    assert newcomer.main(["--url", server.url]) == 1  # every chat id: echo repeats the questions
    captured = capsys.readouterr()
    assert "echo" in captured.err and "good" not in captured.err  # slow answers well, in about a second
    assert "echo                         0/5" in captured.out


def test_a_question_that_times_out_fails_that_id_and_the_run_goes_on(server: LiveServer,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    import httpx

    with httpx.Client(base_url=server.url, timeout=0.05) as client:  # slow takes 0.05 s a token
        outcome = newcomer.check_model(client, "slow")
    assert outcome.passed == [] and all("Timeout" in text for text in outcome.failed.values())
