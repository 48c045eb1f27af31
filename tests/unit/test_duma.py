"""DUMA (engines/families/duma.py) on a tiny random encoder: shapes, option-permutation equivariance, training,
checkpoints, the served scorer (``/v1/choices``, ``choice_average`` ensembles) and every error."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from chorus.config import ChorusConfig
from chorus.engines.core.registry import build_engine
from chorus.engines.fake.engine import FakeEngine
from chorus.engines.families.duma import (
    DumaConfig,
    DumaScorer,
    encode_pairs,
    load_duma,
    new_duma,
    save_duma,
    score_items,
    tiny_encoder,
)
from chorus.engines.transformers.scorer import ScorerEngine
from chorus.errors import BuildError
from chorus.training.duma import TrainConfig, accuracy, loss_of, read_items, train_duma
from tests.helpers import LiveServer, gateway

ITEMS = [("Question: which animal barks?\nAnswer: ", ["a dog", "a cat", "a fish"]),
         ("The sun rises in the ", ["east", "west"])]


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_encoder(tmp_path_factory.mktemp("tiny-encoder"))


def scorer(encoder: Path, **cfg: Any) -> tuple[DumaScorer, Any]:
    model, tok = new_duma(str(encoder), DumaConfig(**cfg), seed=0)
    return model.eval(), tok


@pytest.mark.parametrize("head,fuse", [("duma", "mul"), ("duma", "sum"), ("duma", "cat"), ("baseline", "cat")])
def test_one_logit_per_option_for_every_head_and_fuse(encoder: Path, head: str, fuse: str) -> None:
    model, tok = scorer(encoder, head=head, fuse=fuse)
    hidden = model.encoder.config.hidden_size
    assert model.classifier.in_features == (2 * hidden if (head, fuse) == ("duma", "cat") else hidden)
    assert hasattr(model, "mha_p") == (head == "duma")
    with torch.inference_mode():
        logits = score_items(model, tok, ITEMS)
    assert [x.shape for x in logits] == [torch.Size([3]), torch.Size([2])]
    assert all(torch.isfinite(x).all() for x in logits)


def test_segments_split_the_prompt_from_the_option(encoder: Path) -> None:
    _, tok = scorer(encoder)
    batch = encode_pairs(tok, ["what is red", "a longer prompt with many more words"], ["apple", "b"], 64)
    for i in range(2):
        real = batch["attention_mask"][i].bool()
        seg = batch["segments"][i][real].tolist()
        assert seg[0] == 0 and seg[-1] == 1 and seg == sorted(seg)  # [CLS] P [SEP] | A [SEP]
        n_option = len(tok(["apple", "b"][i], add_special_tokens=False)["input_ids"]) + 1
        assert seg.count(1) == n_option


@pytest.mark.parametrize("head,fuse", [("duma", "mul"), ("duma", "cat"), ("baseline", "cat")])
def test_permuting_the_options_permutes_the_probabilities(encoder: Path, head: str, fuse: str) -> None:
    model, tok = scorer(encoder, head=head, fuse=fuse)
    prompt, options = ITEMS[0][0], ["a dog", "a cat", "a fish", "a bird"]
    perm = [2, 0, 3, 1]
    with torch.inference_mode():
        p = score_items(model, tok, [(prompt, options)])[0].softmax(-1)
        q = score_items(model, tok, [(prompt, [options[i] for i in perm])])[0].softmax(-1)
    assert torch.allclose(q, p[perm], atol=1e-5)


def toy_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """A separable toy task: the right option is the adjective the question names."""
    import random

    rng = random.Random(seed)
    nouns = ["dog", "cat", "car", "tree", "house", "river", "book", "song"]
    rows = []
    for _ in range(n):
        word, other = rng.sample(["good", "bad", "big", "small"], 2)
        label = rng.randrange(2)
        choices = [word, other] if label == 0 else [other, word]
        rows.append({"question": f"Which word describes the {word} {rng.choice(nouns)}?", "choices": choices,
                     "label": label})
    return rows


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_training_lowers_the_loss_and_selects_on_dev(encoder: Path, tmp_path: Path) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", toy_rows(48))
    dev = write_jsonl(tmp_path / "dev.jsonl", toy_rows(16, seed=1))
    items = read_items(train)
    before, tok = scorer(encoder, dropout=0.0)
    with torch.inference_mode():
        loss0 = float(
            loss_of(score_items(before, tok, [(i.prompt, i.choices) for i in items]), [i.label for i in items])
        )
    logs: list[str] = []
    summary = train_duma(train, tmp_path / "out", DumaConfig(dropout=0.0),
                         TrainConfig(epochs=10, batch_size=8, lr=1e-3, head_lr=1e-2, evals_per_epoch=1, log_every=6),
                         dev=dev, encoder=str(encoder), log=logs.append)
    model, tok = load_duma(tmp_path / "out")
    with torch.inference_mode():
        loss1 = float(
            loss_of(score_items(model, tok, [(i.prompt, i.choices) for i in items]), [i.label for i in items])
        )
    assert loss1 < 0.5 * loss0, (loss0, loss1, logs)
    assert summary["best_dev_accuracy"] == max(h["dev_accuracy"] for h in summary["history"])
    assert accuracy(model, tok, read_items(dev)) == pytest.approx(summary["best_dev_accuracy"])
    assert len(summary["history"]) == 10 and summary["dev_items"] == 16 and summary["best_dev_accuracy"] >= 0.75
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (
        saved["model_type"] == "chorus_duma" and saved["training"]["best_dev_accuracy"] == summary["best_dev_accuracy"]
    )
    assert not list(tmp_path.glob(".out.tmp-*"))  # written atomically


def test_a_checkpoint_round_trips_exactly(encoder: Path, tmp_path: Path) -> None:
    model, tok = scorer(encoder, fuse="mul", heads=2, max_length=48)
    (tmp_path / "ck").mkdir()
    save_duma(model, tok, tmp_path / "ck")
    again, tok2 = load_duma(tmp_path / "ck")
    assert again.cfg.fuse == "mul" and again.cfg.heads == 2 and again.cfg.max_length == 48
    assert not any(p.requires_grad for p in again.parameters())
    with torch.inference_mode():
        for a, b in zip(score_items(model, tok, ITEMS), score_items(again, tok2, ITEMS)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("row,error", [
    ("{not json", "not JSON"),
    ({"question": "q", "label": 0}, "'choices' must be a list of at least two"),
    ({"question": "q", "choices": ["a"], "label": 0}, "'choices' must be a list of at least two"),
    ({"question": "q", "choices": ["a", ""], "label": 0}, "'choices' must be a list of at least two"),
    ({"question": "q", "choices": ["a", "b"], "label": 2}, "'label' must be an integer index into the 2"),
    ({"question": "q", "choices": ["a", "b"], "label": True}, "'label' must be an integer"),
    ({"question": "q", "choices": ["a", "b"]}, "'label' must be an integer"),
    ({"choices": ["a", "b"], "label": 0}, "'question', 'goal' or 'context'"),
])
def test_bad_data_is_refused_before_training_naming_the_line(tmp_path: Path, row: Any, error: str) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "ok", "choices": ["a", "b"], "label": 1}, row])
    with pytest.raises(BuildError, match=error) as info:
        read_items(path)
    assert f"{path}:2" in str(info.value)


def test_prompts_are_what_chorus_eval_sends(tmp_path: Path) -> None:
    from chorus.clients.eval_choices import load_items

    rows = [{"question": "q1?", "choices": ["a", "b"], "label": 0}, {"goal": "g", "choices": ["a", "b"], "label": 1},
            {"context": "He opened the", "choices": ["admission", "b"], "label": 0},
            {"context": "A passage.", "question": "Why?", "choices": ["a", "b"], "label": 1}]
    path = write_jsonl(tmp_path / "mc.jsonl", rows)
    assert [i.prompt for i in read_items(path)] == [i.prompt for i in load_items(path, 0, None)]


def test_the_cli_refuses_bad_settings_and_data_with_a_clear_error(encoder: Path, tmp_path: Path) -> None:
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "choices": ["a", "b"], "label": 5}])
    cli = [sys.executable, "-m", "chorus", "train", "duma", "--encoder", str(encoder)]
    r = subprocess.run([*cli, "--data", str(bad), "--out", str(tmp_path / "o")], capture_output=True, text=True)
    assert r.returncode == 2 and "bad.jsonl:1: 'label' must be an integer index" in r.stderr
    assert not (tmp_path / "o").exists()
    r = subprocess.run([*cli, "--data", str(bad), "--out", str(tmp_path / "o"), "--max-length", "4"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "max_length must be at least 8" in r.stderr
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    r = subprocess.run([*cli, "--data", str(bad), "--out", str(tmp_path / "full")], capture_output=True, text=True)
    assert r.returncode == 2 and "already exists" in r.stderr
    with pytest.raises(BuildError, match="not 'minilm' and no Hugging Face checkpoint"):
        new_duma(str(tmp_path / "nowhere"), DumaConfig())
    with pytest.raises(BuildError, match="fuse must be one of mul, sum, cat"):
        DumaConfig(fuse="max").check()


# -- served ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(encoder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, ScorerEngine]]:
    ck = tmp_path_factory.mktemp("duma-ck")
    model, tok = scorer(encoder)
    save_duma(model, tok, ck)
    config = ChorusConfig.model_validate({
        "models": [{"name": "duma", "path": str(ck)}, {"name": "fake", "engine": "fake"}],
        "ensembles": [{"name": "duma+fake", "strategy": "choice_average", "members": ["duma", "fake"],
                       "weights": [3, 1]}]})
    engine = build_engine(config.models[0])
    assert isinstance(engine, ScorerEngine)
    with gateway(config, {"duma": engine, "fake": FakeEngine("fake")}) as srv:
        yield srv, engine


def post(srv: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=30)


def test_served_scores_equal_the_modules_own_forward(served: tuple[LiveServer, ScorerEngine]) -> None:
    srv, engine = served
    prompt, options = ITEMS[0]
    r = post(srv, "/v1/choices", {"model": "duma", "prompt": prompt, "choices": options})
    assert r.status_code == 200, r.text
    out = r.json()
    with torch.inference_mode():
        want = score_items(engine.model, engine.hf_tokenizer, [(prompt, options)])[0].softmax(-1).tolist()
    for norm in ("sum", "mean", "char", "unconditional"):
        assert [c["probabilities"][norm] for c in out["choices"]] == pytest.approx(want, abs=1e-6)
    assert [math.exp(c["logprob"]) for c in out["choices"]] == pytest.approx(want, abs=1e-6)
    assert all(c["tokens"] is None for c in out["choices"])
    assert out["chosen"]["sum"] == max(range(3), key=want.__getitem__)
    assert out["usage"]["prompt_tokens"] > 0


def test_the_model_list_says_what_the_scorer_is(served: tuple[LiveServer, ScorerEngine], encoder: Path) -> None:
    srv, _ = served
    cards = {c["id"]: c for c in httpx.get(srv.url + "/v1/models").json()["data"]}
    assert cards["duma"]["kind"] == "scorer" and cards["duma"]["capabilities"] == ["choices"]
    assert cards["duma"]["scorer"] == {"family": "duma", "head": "duma", "fuse": "cat", "encoder": str(encoder),
                                       "max_length": 128}
    assert cards["fake"]["kind"] == "language_model" and "text" in cards["fake"]["capabilities"]
    assert cards["duma+fake"]["kind"] == "ensemble" and cards["duma+fake"]["ensemble"]["strategy"] == "choice_average"


def test_an_ensemble_averages_the_scorer_with_a_language_model(served: tuple[LiveServer, ScorerEngine]) -> None:
    srv, _ = served
    prompt, options = "abc ", ["ab", "ca", "bbb"]
    body = {"prompt": prompt, "choices": options, "normalisations": ["sum", "char"]}
    members = [post(srv, "/v1/choices", {**body, "model": m}).json() for m in ("duma", "fake")]
    out = post(srv, "/v1/choices", {**body, "model": "duma+fake", "trace": True}).json()
    for norm in ("sum", "char"):
        want = [0.75 * a["probabilities"][norm] + 0.25 * b["probabilities"][norm]
                for a, b in zip(members[0]["choices"], members[1]["choices"])]
        assert [c["probabilities"][norm] for c in out["choices"]] == pytest.approx(want, abs=1e-6)
    assert out["ensemble"]["weights"] == [0.75, 0.25] and out["ensemble"]["usage"]["calls"] == 2
    inline = post(srv, "/v1/choices", {**body, "model": "x", "ensemble": {
        "strategy": "choice_average", "members": ["duma", "fake"], "weights": [3, 1]}}).json()
    assert inline["choices"] == out["choices"]


@pytest.mark.parametrize("path,body,param,message", [
    ("/v1/chat/completions", {"model": "duma", "messages": [{"role": "user", "content": "hi"}]}, "model",
     "multiple-choice scorer"),
    ("/v1/completions", {"model": "duma", "prompt": "hi"}, "model", "multiple-choice scorer"),
    ("/v1/choices", {"model": "duma", "messages": [{"role": "user", "content": "q"}], "choices": ["a", "b"]},
     "messages", "reads a text 'prompt'"),
    ("/v1/choices", {"model": "duma", "prompt": "q", "choices": ["a", "b"], "logprobs": True}, "logprobs",
     "no token logprobs"),
    ("/v1/choices", {"model": "duma", "prompt": "  ", "choices": ["a", "b"]}, "prompt", "needs a prompt with text"),
    ("/v1/choices", {"model": "duma", "prompt": "q", "choices": ["a", " "]}, "choices", "choices[1] is empty"),
    ("/v1/chat/completions", {"model": "duma+fake", "messages": [{"role": "user", "content": "hi"}]}, "model",
     "scores choices only"),
    ("/v1/chat/completions", {"model": "x", "messages": [{"role": "user", "content": "hi"}],
                              "ensemble": {"strategy": "logit_average", "members": ["fake", "duma"]}},
     "ensemble.members", "can only join a 'choice_average' ensemble"),
    ("/v1/choices", {"model": "x", "prompt": "q", "choices": ["a", "b"],
                     "ensemble": {"strategy": "choice_average", "members": ["fake", "duma"], "weights": [1]}},
     "ensemble.weights", "2 non-negative numbers"),
    ("/v1/chorus/v2/sessions", {"model": "duma", "prompt": [1, 2]}, "model", "no token-level logits"),
])
def test_what_a_scorer_cannot_do_is_a_400_naming_the_param(served: tuple[LiveServer, ScorerEngine], path: str,
                                                            body: dict[str, Any], param: str, message: str) -> None:
    srv, _ = served
    r = post(srv, path.replace("/v1/chorus", "/chorus"), body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err


def test_chorus_eval_scores_a_scorer_next_to_a_language_model(served: tuple[LiveServer, ScorerEngine],
                                                              tmp_path: Path) -> None:
    srv, _ = served
    data = write_jsonl(tmp_path / "mc.jsonl", [{"id": f"q{i}", "question": f"question {i}", "choices": ["abc", "zzz"],
                                               "label": i % 2} for i in range(8)])
    cmd = [sys.executable, "-m", "chorus", "eval", "--url", srv.url + "/v1", "--data", str(data), "--model", "duma",
           "--model", "fake", "--mix", json.dumps({"label": "avg", "members": ["duma", "fake"]}),
           "--ensemble", json.dumps({"label": "served", "strategy": "choice_average", "members": ["duma", "fake"]})]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout
    rows = {line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ") and "acc [" not in line}
    assert rows == {"duma", "fake", "avg", "served"}
    agree = next(line for line in out.splitlines() if line.startswith("- served (served) vs avg (from"))
    assert float(agree.split("probability ")[1].split()[0]) < 1e-6  # the served average = the cached scores'
