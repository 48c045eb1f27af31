"""The model families of the default config (smollm2-moe, smollm2-modr, smollm2-reasonformer) on the real SmolLM2,
via the openai SDK."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from chorus.config import ChorusConfig
from chorus.engines.families.modr import load_modr
from chorus.engines.families.reasonformer import load_reasonformer
from tests.helpers import SMOL, LiveServer, gateway

pytestmark = pytest.mark.integration

MOE, MODR, RF = "smollm2-moe", "smollm2-modr", "smollm2-reasonformer"
ASK = [{"role": "user", "content": "What is the capital of France?"}]


def test_prepared_family_checkpoints_reproduce_the_dense_model(default_config: ChorusConfig) -> None:
    """Identical experts (upcycling) and one recurrence with fresh branches (MoDr) are the dense model."""
    dense_dir = default_config.model(SMOL).checkpoint_dir()
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 1, 2, 30, 4000, 17, 18]])
    dense = AutoModelForCausalLM.from_pretrained(dense_dir).eval()
    moe = AutoModelForCausalLM.from_pretrained(default_config.model(MOE).checkpoint_dir()).eval()
    modr = load_modr(default_config.model(MODR).checkpoint_dir())
    rf = load_reasonformer(default_config.model(RF).checkpoint_dir())
    with torch.no_grad():
        want = dense(ids).logits
        assert (moe(ids).logits - want).abs().max() < 1e-4
        assert (modr(ids, recurrence=1).logits - want).abs().max() < 1e-4
        assert (rf(ids, max_steps=1).logits - want).abs().max() < 1e-4  # one step, fresh skills: the base
        assert (rf(ids).logits - want).abs().max() < 1e-4  # fresh gates are closed: it stops after step 1
    assert (rf.cfg.representation, rf.cfg.block, rf.cfg.coda, rf.cfg.top_k) == ((0, 12), (12, 18), (18, 30), 2)
    assert type(moe).__name__ == "MixtralForCausalLM" and moe.config.num_local_experts == 4
    assert (modr.cfg.prelude, modr.cfg.core, modr.cfg.coda, modr.cfg.branches) == ((0, 6), (6, 24), (24, 30), 4)


def test_families_listed_and_answer_like_the_dense_model(sdk: openai.OpenAI) -> None:
    ids = {m.id for m in sdk.models.list()}
    assert {MOE, MODR, RF, "families-default"} <= ids
    want = (
        sdk.chat.completions.create(model=SMOL, messages=ASK, temperature=0, max_tokens=16).choices[0].message.content
    )
    for model in (MOE, MODR, RF, "families-default"):
        got = sdk.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=16)
        assert got.choices[0].message.content == want, model  # all share SmolLM2's function and vocabulary


def test_moe_trace_and_metrics(sdk: openai.OpenAI, real_server: LiveServer) -> None:
    r = sdk.chat.completions.create(model=MOE, messages=ASK, temperature=0, max_tokens=8, extra_body={"trace": True})
    load = r.model_extra["trace"]["experts"]
    counts = torch.tensor(load["tokens_per_expert"])
    assert counts.shape == (30, 4)
    # every prompt token the prefix cache did not serve and every generated token but the last (which is sampled,
    # not fed back) is routed to 2 experts
    cached = r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
    tokens = r.usage.prompt_tokens - cached + r.usage.completion_tokens - 1
    assert (counts.sum(1) == 2 * tokens).all()
    assert 0 < load["balance"] <= 1
    text = httpx.get(real_server.url + "/metrics").text
    assert f'chorus_moe_expert_tokens_total{{expert="0",layer="0",model="{MOE}"}}' in text


def test_modr_recurrence_exit_and_trace(sdk: openai.OpenAI) -> None:
    r = sdk.chat.completions.create(model=MODR, messages=ASK, temperature=0, max_tokens=6,
                                    extra_body={"recurrence": 3, "trace": True})
    modr = r.model_extra["trace"]["modr"]
    assert modr["recurrence"] == 3 and modr["prompt"][0]["steps"] == 3
    assert modr["choices"][0]["steps"] == [3] * (r.usage.completion_tokens - 1)
    assert all(len(b) == 3 and all(0 <= x < 4 for x in b) for b in modr["choices"][0]["branches"])
    ex = sdk.chat.completions.create(model=MODR, messages=ASK, temperature=0, max_tokens=6,
                                     extra_body={"recurrence": 6, "exit": {"kl": 10.0}, "trace": True})
    steps = ex.model_extra["trace"]["modr"]["choices"][0]["steps"]
    assert steps and all(2 <= s < 6 for s in steps)  # a loose threshold stops every token early


def test_modr_trace_streams_on_the_last_chunk(sdk: openai.OpenAI) -> None:
    chunks = list(sdk.chat.completions.create(model=MODR, messages=ASK, temperature=0, max_tokens=5, stream=True,
                                              extra_body={"recurrence": 2, "trace": True}))
    last = chunks[-1]
    assert last.choices == [] and last.model_extra["trace"]["modr"]["recurrence"] == 2


@pytest.mark.parametrize("model,body,param", [
    (MODR, {"recurrence": 0}, "recurrence"),
    (MODR, {"recurrence": 1000}, "recurrence"),
    (MODR, {"exit": {"kl": "small"}}, "exit"),
    (SMOL, {"recurrence": 2}, "recurrence"),
    (MOE, {"exit": {"kl": 1e-3}}, "exit"),
    (RF, {"max_steps": 4}, "max_steps"),
    (RF, {"stop_threshold": -0.1}, "stop_threshold"),
    (RF, {"recurrence": 2}, "recurrence"),
    (MODR, {"stop_threshold": 0.3}, "stop_threshold"),
    (SMOL, {"max_steps": 2}, "max_steps"),
])
def test_family_options_refused_with_400(sdk: openai.OpenAI, model: str, body: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model=model, messages=ASK, max_tokens=4, extra_body=body)
    assert err.value.body["param"] == param


def test_modr_branch_metrics(sdk: openai.OpenAI, real_server: LiveServer) -> None:
    sdk.completions.create(model=MODR, prompt="Once upon a time", max_tokens=4, temperature=0)
    text = httpx.get(real_server.url + "/metrics").text
    assert f'chorus_modr_branch_selections_total{{branch="0",model="{MODR}"}}' in text
    assert f'chorus_modr_decoded_tokens_total{{model="{MODR}"}}' in text


def test_reasonformer_depth_trace_and_metrics(sdk: openai.OpenAI, real_server: LiveServer) -> None:
    """Per request: threshold 0 runs every step up to max_steps, the default threshold stops the fresh gates after
    step 1; the trace gives each step's skill weights, the depth and the gate; Prometheus counts both."""
    r = sdk.chat.completions.create(model=RF, messages=ASK, temperature=0, max_tokens=4, n=2,
                                    extra_body={"max_steps": 2, "stop_threshold": 0.0, "trace": True})
    rf = r.model_extra["trace"]["reasonformer"]
    assert rf["max_steps"] == 2 and rf["stop_threshold"] == 0.0 and len(rf["choices"]) == 2
    for choice in rf["choices"]:
        assert choice["depth"] == 2 and choice["stop_gate"] is None
        assert [len(s["skills"]) for s in choice["steps"]] == [2, 2]  # top-2
        assert all(abs(sum(s["skills"].values()) - 1) < 1e-3 for s in choice["steps"])
        assert set(choice["steps"][0]["skills"]) <= {"math", "science", "commonsense", "general"}
    d = sdk.chat.completions.create(model=RF, messages=ASK, temperature=0, max_tokens=4, extra_body={"trace": True})
    default = d.model_extra["trace"]["reasonformer"]["choices"][0]
    assert default["depth"] == 1 and 0 < default["stop_gate"] < 0.5
    text = httpx.get(real_server.url + "/metrics").text
    assert f'chorus_reasonformer_skill_weight_sum{{model="{RF}",skill="math"}}' in text
    assert f'chorus_reasonformer_steps_total{{model="{RF}"}}' in text


def test_reasonformer_choices_decide_on_the_prompt(real_server: LiveServer) -> None:
    """/v1/choices on ReasonFormer prefills the question once (the decision is made on it, as in generation)
    and feeds each answer after it: the fresh retrofit stops after step 1, so the scores are SmolLM2's."""
    body = {"prompt": "Question: Which is a mammal?\nAnswer: ", "choices": ["a whale", "a shark", "a trout"]}
    got = {m: httpx.post(real_server.url + "/v1/choices", json={**body, "model": m}, timeout=120).json()
           for m in (SMOL, RF)}
    for a, b in zip(got[SMOL]["choices"], got[RF]["choices"]):
        assert abs(a["logprob"] - b["logprob"]) < 1e-3 and a["tokens"] == b["tokens"]


def test_trained_deepseek_moe_from_smollm2_is_served_unchanged(default_config: ChorusConfig, tmp_path: Path) -> None:
    """`chorus train moe --router deepseek` on the real SmolLM2 (2 experts, 2 short steps: the path, not the
    quality), then served from `path:`: the GLM-4-MoE checkpoint answers through the openai SDK and its trace
    counts 2 experts per token in every layer."""
    from chorus.engines.core.spec import ModelSpec
    from chorus.training.moe import MoeTrainConfig, train_moe

    base = default_config.model(SMOL).checkpoint_dir()
    data = tmp_path / "gsm.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"Tom has {a} apples and buys {b} more. How many now?",
                                         "answer": str(a + b)}) for a in range(20) for b in range(3)))
    out = tmp_path / "moe"
    tc = MoeTrainConfig(router="deepseek", experts=2, top_k=2, steps=2, batch_size=1, seq_len=32, lr=1e-4,
                        bias_speed=0.01, eval_sequences=2, log_every=100)
    summary = train_moe(base, data, out, tc, log=lambda _: None)
    assert summary["dropped_share"] == 0 and summary["aux_loss_mean"] == 0
    with gateway(ChorusConfig(models=[ModelSpec(name="trained-moe", path=str(out))]), timeout=300) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        r = client.chat.completions.create(model="trained-moe", messages=ASK, temperature=0, max_tokens=6,
                                           extra_body={"trace": True})
        assert r.choices[0].message.content and r.usage is not None
        counts = torch.tensor(r.model_extra["trace"]["experts"]["tokens_per_expert"])
        assert counts.shape == (30, 2)
        assert (counts.sum(1) == 2 * (r.usage.prompt_tokens + r.usage.completion_tokens - 1)).all()
