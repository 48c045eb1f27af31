"""``POST /v1/choices`` over fake engines: the response, the normalisations, ensembles, and every 400."""

from __future__ import annotations

import math
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from chorus import stats as S
from chorus.engines.core.scoring import mixture_logprob, neutral_prefix, normalised, softmax, split_text
from chorus.engines.fake.engine import FakeEngine
from tests.helpers import LiveServer


def post(server: LiveServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + "/v1/choices", json=body, timeout=30)


async def manual_logprob(engine: FakeEngine, prefix: list[int], cont: list[int]) -> float:
    lps = await engine.prompt_logprobs(prefix + cont, 0)
    return math.fsum(t.logprob for t in lps[len(prefix):] if t is not None)


def test_lm_eval_split_moves_the_prompts_trailing_space_into_the_choices() -> None:
    tok = FakeEngine().tokenizer
    split = split_text(tok, "Question: a\nAnswer: ", ["yes", "no"])
    assert tok.decode(split.prefix) == "Question: a\nAnswer:"
    assert [tok.decode(c) for c in split.choices] == [" yes", " no"]
    empty = split_text(tok, "", ["ab"])
    assert empty.prefix == neutral_prefix(tok) and tok.decode(empty.choices[0]) == "ab"


def test_normalisations_and_mixtures_are_the_documented_formulas() -> None:
    scores = normalised([-4.0, -6.0], [2, 3], [4, 12], [-1.0, -5.0])
    assert scores == {"sum": [-4.0, -6.0], "mean": [-2.0, -2.0], "char": [-1.0, -0.5], "unconditional": [-3.0, -1.0]}
    assert sum(softmax([1.0, 2.0, 3.0])) == pytest.approx(1.0)
    got = mixture_logprob([[-1.0, -2.0], [-3.0, -0.5]], [0.25, 0.75])
    want = [math.log(0.25 * math.exp(-1) + 0.75 * math.exp(-3)), math.log(0.25 * math.exp(-2) + 0.75 * math.exp(-0.5))]
    assert got == pytest.approx(want)
    assert S.token_mixture([[-1.0, -2.0], [-3.0, -0.5]], np.array([1.0, 3.0])) == pytest.approx(sum(want))


async def test_a_single_model_scores_each_choice_after_the_prompt(
    server: LiveServer, fakes: dict[str, FakeEngine]
) -> None:
    r = post(server, {"model": "fake", "prompt": "abc ", "choices": ["ab", "ca", "bbb"], "logprobs": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "choice.scores" and out["model"] == "fake"
    engine = fakes["fake"]
    split = split_text(engine.tokenizer, "abc ", ["ab", "ca", "bbb"])
    for c, cont in zip(out["choices"], split.choices):
        assert c["logprob"] == pytest.approx(await manual_logprob(engine, split.prefix, cont), abs=1e-5)
        assert c["tokens"] == len(cont) and len(c["token_logprobs"]) == len(cont)
        assert c["unconditional_logprob"] == pytest.approx(
            await manual_logprob(engine, neutral_prefix(engine.tokenizer), cont), abs=1e-5)
    for norm in ("sum", "mean", "char", "unconditional"):
        probs = [c["probabilities"][norm] for c in out["choices"]]
        assert sum(probs) == pytest.approx(1.0)
        assert out["chosen"][norm] == int(np.argmax(probs))
    char = softmax([c["logprob"] / len(c["text"]) for c in out["choices"]])
    assert [c["probabilities"]["char"] for c in out["choices"]] == pytest.approx(char)
    tokens = len(split.prefix) + 2 * sum(len(c) for c in split.choices) + len(neutral_prefix(engine.tokenizer))
    assert out["usage"] == {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens}


def test_messages_and_a_subset_of_normalisations(server: LiveServer) -> None:
    r = post(server, {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "choices": ["a", "b"],
                      "normalisations": ["sum"]})
    assert r.status_code == 200, r.text
    assert set(r.json()["chosen"]) == {"sum"} and set(r.json()["choices"][0]["probabilities"]) == {"sum"}


def test_the_openai_sdk_reaches_choices_with_client_post(client: openai.OpenAI) -> None:
    out = client.post("/choices", cast_to=object, body={"model": "fake", "prompt": "ab", "choices": ["c", "a"]})
    assert isinstance(out, dict) and out["object"] == "choice.scores" and len(out["choices"]) == 2


@pytest.mark.parametrize(("body", "param"), [
    ({"choices": []}, "choices"),
    ({"choices": ["a"] * 33}, "choices"),
    ({"choices": [""]}, "choices"),
    ({"choices": ["a" * 80]}, "choices"),  # the fake model's context is 64 tokens
    ({"choices": ["a"], "normalisations": ["bytes"]}, "normalisations"),
    ({"choices": ["a"], "normalisations": []}, "normalisations"),
    ({"choices": ["a"], "messages": [{"role": "user", "content": "x"}]}, "prompt"),
    ({"choices": ["a"], "combine": "tokens"}, "combine"),
    ({"choices": ["a"], "combine": "votes"}, "combine"),
    ({"choices": ["a"], "trace": True}, "trace"),
    ({"choices": ["a"], "temperature": 0.5}, "temperature"),
])
def test_bad_requests_are_400s_naming_the_field(server: LiveServer, body: dict[str, Any], param: str) -> None:
    r = post(server, {"model": "fake", "prompt": "ab", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


def test_unknown_models_are_404s(server: LiveServer) -> None:
    r = post(server, {"model": "nope", "prompt": "ab", "choices": ["a"]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def single(server: LiveServer, model: str, prompt: str, choices: list[str]) -> dict[str, Any]:
    return post(server, {"model": model, "prompt": prompt, "choices": choices, "logprobs": True}).json()


def test_an_ensemble_averages_its_members_distributions_over_the_choices(server: LiveServer) -> None:
    prompt, choices = "abc ", ["ab", "ca"]
    members = ["fake", "scripted"]
    ens = {"strategy": "crowd_vote", "members": members}
    r = post(server, {"model": "x", "prompt": prompt, "choices": choices, "ensemble": ens, "trace": True})
    assert r.status_code == 200, r.text
    out = r.json()
    alone = [single(server, m, prompt, choices) for m in members]
    for i, c in enumerate(out["choices"]):
        assert c["logprob"] is None and c["tokens"] is None
        for norm, p in c["probabilities"].items():
            assert p == pytest.approx(sum(a["choices"][i]["probabilities"][norm] for a in alone) / 2)
    trace = out["ensemble"]
    assert trace["combine"] == "probabilities" and trace["usage"]["calls"] == 2
    assert [s["member"] for s in trace["scores"]] == members
    assert out["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)


def test_weights_and_the_per_token_mixture_of_one_vocabulary(server: LiveServer) -> None:
    prompt, choices = "abc ", ["ab", "cab"]
    members = ["fake", "scripted"]
    alone = [single(server, m, prompt, choices) for m in members]
    base = {"model": "x", "prompt": prompt, "choices": choices, "logprobs": True}
    ens = {"strategy": "logit_average", "members": members, "weights": [1, 3]}
    tokens = post(server, {**base, "ensemble": ens}).json()
    for i, c in enumerate(tokens["choices"]):
        want = mixture_logprob([a["choices"][i]["token_logprobs"] for a in alone], [0.25, 0.75])
        assert c["token_logprobs"] == pytest.approx(want, abs=1e-5)
        assert c["logprob"] == pytest.approx(sum(want), abs=1e-5)
    probs = post(server, {**base, "logprobs": False, "ensemble": ens, "combine": "probabilities"}).json()
    for i, c in enumerate(probs["choices"]):
        want = (
            0.25 * alone[0]["choices"][i]["probabilities"]["sum"]
            + 0.75 * alone[1]["choices"][i]["probabilities"]["sum"]
        )
        assert c["probabilities"]["sum"] == pytest.approx(want)
    r = post(server, {**base, "ensemble": ens, "combine": "probabilities"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    r = post(server, {**base, "ensemble": {**ens, "weights": [1]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "ensemble.weights"


def test_cached_scores_combine_like_the_server() -> None:
    rng = np.random.default_rng(0)
    a, b = rng.dirichlet([1, 1, 1], 50), rng.dirichlet([1, 1, 1], 50)
    assert S.combine([a, b], np.array([1.0, 1.0]), "linear") == pytest.approx((a + b) / 2)
    log = S.combine([a, b], np.array([1.0, 1.0]), "log")
    assert log == pytest.approx(np.sqrt(a * b) / np.sqrt(a * b).sum(axis=1, keepdims=True))
    conf = S.combine([a, b], np.array([1.0, 1.0]), "confident")
    assert all((conf[i] == (a[i] if a[i].max() >= b[i].max() else b[i])).all() for i in range(50))
    gold = a.argmax(axis=1)  # member a is always right: fitting puts its weight at 1
    assert S.fit_weights([a, b], gold, "linear")[0] > 0.5


def test_paired_difference_counts_discordant_items() -> None:
    sys_ = np.array([1] * 30 + [0] * 10 + [1] * 60)
    ref = np.array([0] * 30 + [1] * 10 + [1] * 60)
    d = S.paired_difference(sys_, ref)
    assert (d.wins, d.losses) == (30, 10) and d.delta == pytest.approx(0.2)
    assert d.low < 0.2 < d.high and d.p_mcnemar == pytest.approx(0.00222, abs=1e-4)  # binomial(30 of 40)
    lo, hi = S.accuracy_interval(np.array([1] * 64 + [0] * 36))
    assert lo < 0.64 < hi


def test_calibration_sharpens_an_underconfident_member() -> None:
    rng = np.random.default_rng(1)
    gold = rng.integers(0, 2, 200)
    right = np.where(rng.random(200) < 0.9, gold, 1 - gold)  # right 90% of the time, but nearly uniform
    p = np.full((200, 2), 0.45)
    p[np.arange(200), right] = 0.55
    t = S.fit_temperature(p, gold)
    assert t < 0.2 and S.sharpen(p, t)[np.arange(200), right].mean() > 0.8
    assert S.sharpen(p, 1.0) == pytest.approx(p)
