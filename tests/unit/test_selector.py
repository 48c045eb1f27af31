"""The learned selector (`chorus train selector`, the `select` strategy): learners on synthetic data where the
answer is recoverable, the fallback, the artifact's round trip, the served strategy giving the offline
predictions exactly (fake members behind a live gateway, over `/v1/choices`), and the errors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from chorus.engines.fake.engine import FakeEngine
from chorus.ensembles.fitted.selector import NORMS, Selector, feature_names
from chorus.errors import ConfigError
from chorus.training.selector import fit_selector
from tests.helpers import LiveServer, serve_fakes


def dist(n: int, top: int, p: float) -> list[float]:
    rest = (1 - p) / (n - 1)
    return [p if c == top else rest for c in range(n)]


def synthetic(n_items: int, seed: int) -> tuple[list[Any], np.ndarray]:
    """Two members, four choices. A is confident (0.9) and right on half the items and unsure (0.4) and wrong
    on the others; B is always moderately sure (0.6) and right exactly where A is unsure: a selector that trusts
    A when A is confident and B otherwise gets every item, each member half of them."""
    rng = np.random.default_rng(seed)
    items, gold = [], []
    for _ in range(n_items):
        g = int(rng.integers(4))
        wrong = (g + 1 + int(rng.integers(3))) % 4
        if rng.random() < 0.5:
            a, b = dist(4, g, 0.9), dist(4, wrong, 0.6)
        else:
            a, b = dist(4, wrong, 0.4), dist(4, g, 0.6)
        items.append([{nm: a for nm in NORMS}, {nm: b for nm in NORMS}])
        gold.append(g)
    return items, np.array(gold)


def test_a_selector_learns_that_the_confident_member_is_right() -> None:
    items, gold = synthetic(300, 0)
    sel = fit_selector(["a", "b"], items, gold, [40] * len(items), data_hash="x")
    cv = sel.training["cv"]
    assert cv["best_member_acc"] == pytest.approx(0.5, abs=0.1) and cv["selector_acc"] > 0.95
    assert sel.fallback is None and cv["gain_ci"][0] > 0
    test_items, test_gold = synthetic(200, 1)  # held out
    chosen = [int(np.argmax(sel.probabilities(a, 40)["sum"])) for a in test_items]
    assert np.mean(np.array(chosen) == test_gold) > 0.95


def test_without_signal_it_falls_back_to_the_best_member_and_says_so() -> None:
    rng = np.random.default_rng(2)
    items, gold = [], []
    for _ in range(200):
        g = int(rng.integers(3))
        good = dist(3, g if rng.random() < 0.7 else (g + 1) % 3, 0.5)  # right 70% of the time
        noise = dist(3, int(rng.integers(3)), 0.5)  # right a third of the time, unrelated to anything
        items.append([{nm: noise for nm in NORMS}, {nm: good for nm in NORMS}])
        gold.append(g)
    sel = fit_selector(["noise", "good"], items, np.array(gold), [10] * 200, data_hash="x")
    assert sel.fallback == "good" and "does not exclude zero" in sel.training["fallback_reason"]
    assert sel.probabilities(items[0], 10) == items[0][1]  # the fallback member's own distribution


def test_the_artifact_round_trips_and_refuses_what_it_cannot_serve(tmp_path: Path) -> None:
    items, gold = synthetic(100, 3)
    sel = fit_selector(["a", "b"], items, gold, [40] * 100, data_hash="abc")
    back = Selector.load(sel.save(tmp_path / "s"))
    assert back == sel and back.probabilities(items[0], 40) == sel.probabilities(items[0], 40)
    assert {"chorus-gateway", "scikit-learn", "numpy"} <= set(back.versions) and back.training["data_sha256"] == "abc"
    raw = json.loads((tmp_path / "s" / "selector.json").read_text())
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**raw, "features": [*raw["features"][:-1], "moon_phase"]}))
    with pytest.raises(ConfigError, match="moon_phase"):
        Selector.load(bad)
    bad.write_text(json.dumps({**raw, "format": 99}))
    with pytest.raises(ConfigError, match="not a chorus select artifact"):
        Selector.load(bad)
    with pytest.raises(ValueError, match="at least 10"):
        fit_selector(["a", "b"], items[:5], gold[:5], [1] * 5, data_hash="x")


DATA = [{"question": f"Which letter comes after {chr(97 + i)}?", "choices": [chr(98 + i), "zz", chr(97 + i)],
         "label": i % 3} for i in range(24)]


@pytest.fixture(scope="module")
def gateway_with_selector(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Two fake members behind a live gateway and a selector trained on them with `chorus train selector`."""
    import os

    from chorus.cli.selector import train_selector

    home = tmp_path_factory.mktemp("home")
    data = home / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in DATA))
    old = os.environ.get("CHORUS_HOME")
    os.environ["CHORUS_HOME"] = str(home)
    engines = {"m1": FakeEngine("m1"), "m2": FakeEngine("m2", script="bzzabc")}
    try:
        with serve_fakes(engines) as srv:
            args = argparse.Namespace(url=srv.url + "/v1", data=str(data), member=["m1", "m2"], out="letters",
                                      cache=str(home / "cache"), offset=0, limit=None, folds=3, seed=0,
                                      concurrency=2, margin=0.0, price=[])
            assert train_selector(args) == 0
            yield srv, home
    finally:
        if old is None:
            os.environ.pop("CHORUS_HOME", None)
        else:
            os.environ["CHORUS_HOME"] = old


def choices(srv: LiveServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(srv.url + "/v1/choices", json=body, timeout=30)


def test_the_served_strategy_gives_the_offline_predictions(gateway_with_selector: Any) -> None:
    srv, home = gateway_with_selector
    trained = Selector.load(home / "selectors" / "letters")  # by `chorus train selector` on the fakes
    assert trained.members == ["m1", "m2"] and trained.features == feature_names(["m1", "m2"])
    items, gold = synthetic(100, 4)  # a learner that does not fall back, for the same members
    learned = fit_selector(["m1", "m2"], items, gold, [40] * 100, data_hash="x")
    assert learned.fallback is None
    learned.save(home / "selectors" / "learned")
    for name, sel in (("letters", trained), ("learned", learned)):
        ensemble = {"strategy": "select", "artifact": name, "members": ["m1", "m2"]}
        for row in DATA[:6]:
            prompt = f"Question: {row['question']}\nAnswer: "
            body = {"prompt": prompt, "choices": row["choices"], "normalisations": list(NORMS)}
            answers = [{nm: [c["probabilities"][nm] for c in choices(srv, {**body, "model": m}).json()["choices"]]
                        for nm in NORMS} for m in ("m1", "m2")]
            want = sel.probabilities(answers, len(prompt))
            got = choices(srv, {**body, "model": "m1", "ensemble": ensemble, "trace": True}).json()
            for nm in NORMS:
                assert [c["probabilities"][nm] for c in got["choices"]] == pytest.approx(want[nm], abs=1e-9)
            trace = got["ensemble"]
            assert trace["selector"] == name and trace["fallback"] == sel.fallback
            assert len(trace["scores"]) == (1 if sel.fallback else 2)  # a fallback asks its member only
    metrics = httpx.get(srv.url + "/metrics").text
    assert "chorus_selector_choices_total" in metrics


@pytest.mark.parametrize("ensemble,param,words", [
    ({"members": ["m2", "m1"]}, "ensemble.members", "trained on members"),
    ({"artifact": "nope"}, "ensemble.artifact", "No selector artifact"),
    ({"artifact": "../../etc"}, "ensemble.artifact", "inside"),
    ({"unknown_knob": 1}, "ensemble", "Valid parameters"),
])
def test_bad_select_ensembles_are_400s(gateway_with_selector: Any, ensemble: dict[str, Any], param: str,
                                       words: str) -> None:
    srv, _ = gateway_with_selector
    spec = {"strategy": "select", "artifact": "letters", "members": ["m1", "m2"], **ensemble}
    r = choices(srv, {"model": "m1", "prompt": "Q: ", "choices": ["a", "b"], "ensemble": spec})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"].startswith(param) and words in err["message"], err


def test_select_generates_nothing_and_reads_text_prompts(gateway_with_selector: Any) -> None:
    srv, _ = gateway_with_selector
    spec = {"strategy": "select", "artifact": "letters", "members": ["m1", "m2"]}
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="scores choices only"):
        client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"ensemble": spec})
    r = choices(srv, {"model": "m1", "messages": [{"role": "user", "content": "Q"}], "choices": ["a", "b"],
                      "ensemble": spec})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_malformed_training_rows_name_the_file_and_line(tmp_path: Path) -> None:
    from chorus.clients.eval_choices import member_answers

    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(DATA[0]) + "\n" + json.dumps({"question": "no choices", "label": 0}) + "\n")
    with pytest.raises(SystemExit, match=rf"{data}:2"):
        member_answers("http://127.0.0.1:9/v1", data, ["m1", "m2"], tmp_path / "cache")


def test_the_evaluation_protocol_fits_on_one_half_and_reports_on_the_other(
        gateway_with_selector: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from chorus.bench.selector import halves, main

    srv, home = gateway_with_selector
    a, b = halves(24, 0)
    assert len(set(a) | set(b)) == 24 and not set(a) & set(b)
    args = argparse.Namespace(url=srv.url + "/v1", train=str(home / "train.jsonl"), test=str(home / "train.jsonl"),
                              member=["m1", "m2"], name="halves", cache=str(home / "cache"), train_limit=None,
                              test_limit=None, split_seed=0, seed=0, concurrency=2, served_check=4,
                              price=[])
    data2 = [*DATA, *({**r, "question": r["question"] + " (again)"} for r in DATA)]
    (home / "train2.jsonl").write_text("\n".join(json.dumps(r) for r in data2))
    args.train = args.test = str(home / "train2.jsonl")
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "24 held-out items" in out and "best on train" in out and "oracle (some member right)" in out
    diff = float(out.split("largest |difference| of a choice's probability ")[1].split()[0])
    assert diff < 1e-9


def test_a_config_naming_a_selector_for_other_members_is_a_config_error(gateway_with_selector: Any) -> None:
    from chorus.config import ChorusConfig

    models = [{"name": n, "engine": "fake"} for n in ("m1", "m2")]
    ok = {"name": "sel", "strategy": "select", "artifact": "letters", "members": ["m1", "m2"]}
    assert ChorusConfig.model_validate({"models": models, "ensembles": [ok]}).ensembles[0].name == "sel"
    with pytest.raises(ValueError, match="trained on members"):
        ChorusConfig.model_validate({"models": models, "ensembles": [{**ok, "members": ["m2", "m1"]}]})


def test_a_router_finds_which_member_is_right_on_which_cluster_of_prompts(tmp_path: Path) -> None:
    """Member A is right on one cluster of prompts, B on another: the k-NN router must send each cluster to its
    member; with A cheaper and a wide margin it sends everything to A."""
    from chorus.ensembles.fitted.learned_router import LearnedRouter
    from chorus.training.selector import fit_router

    rng = np.random.default_rng(0)
    centres = np.eye(8)[:2]
    emb = np.concatenate([centres[c] + 0.05 * rng.standard_normal((60, 8)) for c in (0, 1)])
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    correct = np.array([[1, 0]] * 60 + [[0, 1]] * 60)
    router = fit_router(["a", "b"], emb, correct, [1.0, 2.0], data_hash="x")
    assert router.fallback is None and router.training["cv"]["router_acc"] > 0.95
    assert router.choose(router.predict(centres[0])[0]) == 0 and router.choose(router.predict(centres[1])[0]) == 1
    assert router.choose(router.predict(centres[1])[0], margin=1.0) == 0  # the cheaper one, inside the margin
    back = LearnedRouter.load(router.save(tmp_path / "r"))
    assert back == router and np.allclose(back.predict(centres[1])[0], router.predict(centres[1])[0])


def test_the_learned_router_serves_one_member_over_choices(gateway_with_selector: Any) -> None:
    from chorus.ensembles.similarity import Embedder
    from chorus.training.selector import fit_router

    srv, home = gateway_with_selector
    prompts = [f"Question: {r['question']}\nAnswer: " for r in DATA]
    correct = np.array([[i % 2, 1 - i % 2] for i in range(len(DATA))])
    router = fit_router(["m1", "m2"], Embedder.embed(prompts), correct, [1.0, 1.0], data_hash="x", folds=3)
    router.save(home / "selectors" / "letters")
    spec = {"strategy": "route", "router": "learned", "artifact": "letters", "members": ["m1", "m2"]}
    r = choices(srv, {"model": "m1", "prompt": prompts[0], "choices": DATA[0]["choices"], "ensemble": spec,
                      "trace": True}).json()
    trace = r["ensemble"]
    assert trace["router"] == "learned" and trace["winner"]["member"] in ("m1", "m2")
    assert set(trace["predicted_correct"]) == {"m1", "m2"} and len(trace["neighbours"]) == router.k
    bad = choices(srv, {"model": "m1", "prompt": "Q", "choices": ["a", "b"],
                        "ensemble": {**spec, "members": ["m2", "m1"]}})
    assert bad.status_code == 400 and "trained on members" in bad.json()["error"]["message"]
    bad = choices(srv, {"model": "m1", "prompt": "Q", "choices": ["a", "b"],
                        "ensemble": {**spec, "router": "semantic", "examples": {"m2": ["x"]}}})
    assert bad.status_code == 400 and "router: learned only" in bad.json()["error"]["message"]
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    out = client.chat.completions.create(model="m1", messages=[{"role": "user", "content": prompts[1]}],
                                         max_tokens=3, extra_body={"ensemble": {**spec, "trace": True}})
    assert out.choices[0].message.content and out.model_extra["ensemble"]["router"] == "learned"


CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Egypt": "Cairo", "Peru": "Lima",
            "Kenya": "Nairobi", "Chile": "Santiago", "Spain": "Madrid", "Greece": "Athens", "Cuba": "Havana",
            "Norway": "Oslo", "Poland": "Warsaw", "Austria": "Vienna", "Ireland": "Dublin", "Portugal": "Lisbon"}


def generative_rows() -> list[dict[str, Any]]:
    """Two clusters of completion prompts: capitals (both members right) and 3-digit sums (only `big` right)."""
    rows: list[dict[str, Any]] = [{"prompt": f"The capital of {c} is", "answer": a} for c, a in CAPITALS.items()]
    rng = np.random.default_rng(0)
    for _ in range(15):
        a, b = (int(x) for x in rng.integers(100, 1000, 2))
        rows.append({"prompt": f"{a} + {b} =", "answer": str(a + b)})
    order = rng.permutation(len(rows))
    return [{**rows[i], "id": f"g{i}"} for i in order]


def reply_for(big: bool) -> Any:
    def reply(prompt: str) -> str:
        if "+" in prompt:
            a, b = (int(x) for x in prompt.rstrip("= ").split("+"))
            return f" {a + b if big else a + b + 1}\n"
        country = prompt.split("capital of ")[1].split(" is")[0]
        return f" {CAPITALS[country]}\n"
    return reply


def test_generative_routing_learns_which_prompts_need_the_big_member(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Labelled generative rows (prompt / answer) -> `chorus train selector` fits only the router; the protocol
    sends the capitals to the cheap member and the sums to the big one, keeping the big member's accuracy with
    about half of its calls, and the served route ensemble (completions) picks what the offline router picks."""
    from chorus.bench.selector import run
    from chorus.cli.selector import train_selector
    from chorus.ensembles.fitted.learned_router import LearnedRouter

    monkeypatch.setenv("CHORUS_HOME", str(tmp_path))
    data = tmp_path / "gen.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in generative_rows()))
    engines = {"small": FakeEngine("small", reply=reply_for(False)), "big": FakeEngine("big", reply=reply_for(True))}
    with serve_fakes(engines) as srv:
        args = argparse.Namespace(url=srv.url + "/v1", data=str(data), member=["small", "big"], out="gen",
                                  cache=str(tmp_path / "cache"), offset=0, limit=None, folds=3, seed=0,
                                  concurrency=2, margin=0.0, price=["small=1", "big=3"], max_tokens=12)
        assert train_selector(args) == 0
        out = capsys.readouterr().out
        assert "no selector" in out and not (tmp_path / "selectors" / "gen" / "selector.json").exists()
        router = LearnedRouter.load(tmp_path / "selectors" / "gen")
        assert router.training["member_acc"] == {"small": 0.5, "big": 1.0}
        assert router.fallback is None and router.training["cv"]["router_acc"] > 0.9
        bench = argparse.Namespace(url=srv.url + "/v1", train=str(data), test=str(data), member=["small", "big"],
                                   name="gen-bench", cache=str(tmp_path / "cache"), train_limit=None,
                                   test_limit=None, split_seed=0, seed=0, concurrency=2, served_check=15,
                                   price=["small=1", "big=3"], max_tokens=12)
        assert run(bench) == 0
    out = capsys.readouterr().out
    assert "15 held-out items" in out and "best on train (big)" in out
    assert "chose the offline router's member on 15 of the first 15" in out, out
    # at margin 0 the predicted best (big) answers everything; a small margin lets small take the capitals
    kept = out.split("keeps its held-out accuracy: ")[1].split("%")[0]
    assert 20 <= int(kept) <= 80, out


def test_malformed_generative_rows_name_the_file_and_line(tmp_path: Path) -> None:
    from chorus.clients.eval_generative import is_right, load_gen_items

    data = tmp_path / "gen.jsonl"
    data.write_text(json.dumps({"prompt": "1 + 1 =", "answer": "2"}) + "\n\n" + json.dumps({"answer": "3"}) + "\n")
    with pytest.raises(SystemExit, match=rf"{data}:3: .*'prompt' or 'question'"):
        load_gen_items(data)
    items = load_gen_items(data, limit=1)
    assert is_right(items[0], " 2\n") and not is_right(items[0], " 3") and not is_right(items[0], "")
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text(json.dumps({"question": "Two apples and one more?", "answer": "One more.\n#### 3"}) + "\n")
    item = load_gen_items(gsm)[0]
    assert item.chat and item.answer == "3" and is_right(item, "So, the answer is 3.")
