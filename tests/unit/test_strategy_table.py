"""Every registered strategy, one row each: the table covers `STRATEGIES` exactly, and each row is served by a live
gateway over fake members (a chat completion, or for a scoring strategy ``/v1/choices``), with its trace. A new
strategy is its module, its line in `STRATEGIES` and its row here."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from chorus.engines.fake.engine import FakeEngine
from chorus.ensembles.base import STRATEGIES, strategy_class
from chorus.training.selector import fit_selector
from tests.helpers import LiveServer, serve_fakes
from tests.unit.test_selector import synthetic

#: strategy -> (endpoint, its fields beyond strategy and members)
TABLE: dict[str, tuple[str, dict[str, Any]]] = {
    "logit_average": ("chat", {}),
    "exchange_of_thought": ("chat", {"max_rounds": 1}),
    "crowd_vote": ("chat", {"metric": "word_rouge_l"}),
    "mixture_of_agents": ("chat", {}),
    "route": ("chat", {"router": "random"}),
    "cascade": ("chat", {"confidence": "mean_logprob", "threshold": -0.5}),
    "answer_vote": ("chat", {"samples": 2, "batch": 2, "answer": "number"}),
    "consistency_select": ("chat", {"samples": 2, "batch": 2, "answer": "number"}),
    "choice_average": ("choices", {}),
    "select": ("choices", {"artifact": "table"}),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    home = tmp_path_factory.mktemp("home")
    mp = pytest.MonkeyPatch()
    mp.setenv("CHORUS_HOME", str(home))
    items, gold = synthetic(60, 3)
    fit_selector(["m1", "m2"], items, gold, [40] * 60, data_hash="table").save(home / "selectors" / "table")
    engines = {"m1": FakeEngine("m1", script="The answer is 42.", max_model_len=4000),
               "m2": FakeEngine("m2", script="Six times seven: the answer is 42.", max_model_len=4000)}
    try:
        with serve_fakes(engines) as srv:
            yield srv
    finally:
        mp.undo()


def test_the_table_is_every_registered_strategy() -> None:
    built_in = {name for name, target in STRATEGIES.items() if target.startswith("chorus.")}  # not a config's
    assert set(TABLE) == built_in
    for name, (_, fields) in TABLE.items():
        strategy_class(name).Params.model_validate(fields)  # the row's fields are the strategy's own


@pytest.mark.parametrize("name", sorted(TABLE))
def test_each_strategy_answers_through_the_gateway(server: LiveServer, name: str) -> None:
    endpoint, fields = TABLE[name]
    ensemble = {"strategy": name, "members": ["m1", "m2"], "trace": True, **fields}
    if endpoint == "chat":
        r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
            "model": "m1", "messages": [{"role": "user", "content": "What is 6*7?"}], "max_tokens": 16,
            "temperature": 0, "ensemble": ensemble})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
    else:
        r = httpx.post(server.url + "/v1/choices", timeout=30, json={
            "model": "m1", "prompt": "Question: which?\nAnswer: ", "choices": ["a", "b", "c"],
            "normalisations": ["sum", "mean", "char"], "ensemble": ensemble})
        assert r.status_code == 200, r.text
        probs = [c["probabilities"] for c in r.json()["choices"]]
        assert len(probs) == 3
    assert r.json()["ensemble"]["strategy"] == name


def test_module_of_each_strategy_is_in_its_room() -> None:
    """Text-level strategies live in ensembles/strategies/, the token-level one in ensembles/logit_average/."""
    for name, target in STRATEGIES.items():
        module = target.split(":")[0]
        if not module.startswith("chorus."):
            continue  # a third-party strategy a config registered (tests/unit/test_ensembles.py)
        assert module.startswith(("chorus.ensembles.strategies.", "chorus.ensembles.logit_average.")), name
        assert Path(*module.split(".")).with_suffix(".py").is_file(), module
