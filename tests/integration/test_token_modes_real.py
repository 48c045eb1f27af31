"""Token ensembles' modes on SmolLM2: multi-token extend / rollback in the real batching engine, speculative
averaging equal to full averaging token for token (SmolLM2 with itself under two system prompts)."""

from __future__ import annotations

import torch

from chorus.engines.core.base import GenerationRequest, SamplingParams
from chorus.engines.transformers.engine import TransformersEngine
from chorus.ensembles.logit_average.mixing import Mixing
from chorus.ensembles.logit_average.shared_vocab import LogitAverage
from tests.helpers import drained

PERSONAS = ("You are a careful teacher. Explain step by step.", "You are a pirate. Answer like one, briefly.")
QUESTION = "Why is the sky blue?"


def persona_ids(engine: TransformersEngine, system: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": QUESTION}])


async def test_catch_up_and_rollback_leave_the_cache_exact(smol_engine: TransformersEngine) -> None:
    """A member that reads 20 missed tokens in one chunk has the distribution of one that stepped each token;
    rolled-back tokens leave no trace (logits to 1e-4)."""
    ids = persona_ids(smol_engine, PERSONAS[0])
    tokens = smol_engine.tokenizer.encode_text(" Sunlight is scattered by the molecules of the air, and blue light "
                                               "is scattered more than red.")[:20]
    stepped, chunked = smol_engine.open_session(), smol_engine.open_session()
    try:
        await stepped.prefill(ids)
        await chunked.prefill(ids)
        every = [await stepped.step(t) for t in tokens]
        caught_up = await chunked.extend(tokens)
        assert max(float((a - b).abs().max()) for a, b in zip(every, caught_up)) < 1e-4
        chunked.rollback(8)
        redo = await chunked.extend(tokens[12:15])
        stepped.rollback(8)
        assert max(float((a - b).abs().max()) for a, b in zip([await stepped.step(t) for t in tokens[12:15]], redo)) \
            < 1e-4
        assert chunked.length == stepped.length == len(ids) + 15
    finally:
        stepped.close()
        chunked.close()
    assert smol_engine.active_sessions == 0


async def test_speculative_prompt_ensemble_equals_full(smol_engine: TransformersEngine) -> None:
    prompts = [persona_ids(smol_engine, p) for p in PERSONAS]
    req = GenerationRequest(prompts[0], SamplingParams(temperature=0, max_tokens=40))
    full = await LogitAverage([smol_engine, smol_engine], prompts=prompts).generate(req)
    spec = LogitAverage([smol_engine, smol_engine], Mixing(mode="speculative", k=4), prompts=prompts)
    got = await spec.generate(req)
    assert got.choices[0].token_ids == full.choices[0].token_ids
    st = spec.tally
    assert 0 < st.accepted < st.proposed and sum(st.rolled_back) > 0  # the personas disagree now and then
    assert st.fed[1] == st.fed[0]  # the other member read exactly the lead's tokens, in rounds
    alone = [await smol_engine.generate(GenerationRequest(p, SamplingParams(temperature=0, max_tokens=40)))
             for p in prompts]
    assert full.choices[0].token_ids not in [g.choices[0].token_ids for g in alone]  # a real mixture
    assert await drained(smol_engine)


async def test_selective_at_a_gate_that_always_fires_equals_full(smol_engine: TransformersEngine) -> None:
    prompts = [persona_ids(smol_engine, p) for p in PERSONAS]
    req = GenerationRequest(prompts[0], SamplingParams(temperature=0, max_tokens=24))
    full = await LogitAverage([smol_engine, smol_engine], prompts=prompts).generate(req)
    sel = LogitAverage([smol_engine, smol_engine], Mixing(mode="selective", gate=1.0), prompts=prompts)
    assert (await sel.generate(req)).choices[0].token_ids == full.choices[0].token_ids
    some = LogitAverage([smol_engine, smol_engine], Mixing(mode="selective", gate=0.5), prompts=prompts)
    await some.generate(req)
    assert 0 < some.tally.consulted < some.tally.positions
    assert torch.is_tensor(some.weights)


def test_bench_modes_runs() -> None:
    """`chorus bench modes` on one pair, tiny budget: the table is printed and speculative equals full."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "chorus", "bench", "modes", "--pairs", "prompt ensemble", "--tokens",
                          "12", "--prompts", "1", "--rounds", "1", "--gates", "0.5"],
                         capture_output=True, text=True, timeout=900, check=True).stdout
    rows = [line for line in out.splitlines() if line.startswith("| SmolLM2 x 2 system prompts")]
    assert [r.split("|")[2].strip().split(",")[0] for r in rows] == [
        "smollm2-135m-instruct alone", "full", "selective", "speculative"]
    assert rows[-1].split("|")[-2].strip() == "yes"
    assert rows[1].split("|")[6].strip() == rows[1].split("|")[5].strip()  # one model: slowest = lead
