"""Token ensembles' modes (full / selective / speculative), and the session operations under them:
multi-token ``extend`` and ``rollback`` in the batching engine (tiny random models) and the fake engine."""

from __future__ import annotations

import asyncio

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from chorus.engines.core.base import GenerationRequest, SamplingParams
from chorus.engines.fake.engine import FakeEngine
from chorus.engines.transformers.batching import MAX_EXTEND, BatchRunner
from chorus.ensembles.logit_average.mixing import Mixing
from chorus.ensembles.logit_average.selective import uncertain
from chorus.ensembles.logit_average.shared_vocab import LogitAverage


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def full(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def close(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


async def test_extend_and_rollback_in_the_batch_equal_a_fresh_forward() -> None:
    """Row A extends several tokens in the same forwards where row B steps one at a time; A rolls back and
    takes other tokens; every distribution equals a forward over the sequence as it now is."""
    model = tiny_llama()
    runner = BatchRunner(model, max_model_len=200)
    try:
        a, b = runner.open_many(1)[0], runner.open_many(1)[0]
        pa, pb = [5, 6, 7, 8], [20, 21, 22]
        await runner.submit_prefill([a], pa)
        await runner.submit_prefill([b], pb)
        ext, steps = [9, 10, 11, 12, 13], [23, 24, 25]

        async def step_b() -> list[torch.Tensor]:
            return [await b.step(t) for t in steps]

        rows, b_out = await asyncio.gather(a.extend(ext), step_b())
        ref_a, ref_b = full(model, pa + ext), full(model, pb + steps)
        assert rows.shape == (5, 128) and close(rows, ref_a[len(pa) :]) < 1e-4
        assert max(close(x, ref_b[len(pb) + i]) for i, x in enumerate(b_out)) < 1e-4
        a.rollback(3)  # forget 11, 12, 13
        assert a.length == len(pa) + 2
        again = await a.extend([40, 41])
        ref = full(model, [*pa, 9, 10, 40, 41])
        assert close(again, ref[len(pa) + 2 :]) < 1e-4
        stepped = await b.step(26)  # the other row is untouched by A's rollback
        assert close(stepped, full(model, pb + steps + [26])[-1]) < 1e-4
        b.close()
        a.rollback(1)
        await a.step(42)
        assert runner.mask is not None and runner.mask.shape[1] - a.length < 8  # holes are few or compacted
        c = runner.open_many(1)[0]
        await runner.submit_prefill([c], [50, 51])
        await a.extend(list(range(60, 80)))
        await c.step(52)
        a.rollback(18)  # 18 holes in A while C's columns sit after them: packed, then exact
        await a.step(43)
        assert runner.mask.shape[1] < a.length + 8
        assert close(await c.step(53), full(model, [50, 51, 52, 53])[-1]) < 1e-4
        assert close(await a.step(44), full(model, [*pa, 9, 10, 40, 42, 60, 61, 43, 44])[-1]) < 1e-4
        a.rollback(4)
        c.close()
        long = list(range(30, 30 + 2 * MAX_EXTEND + 3))  # more than one forward's worth
        out = await a.extend(long)
        ref = full(model, [*pa, 9, 10, 40, 42, *long])
        assert out.shape[0] == len(long) and close(out, ref[len(pa) + 4 :]) < 1e-4
        with pytest.raises(Exception, match="cannot roll back"):
            a.rollback(a.length)
        a.close()
    finally:
        await runner.stop()


def scripted(**kw: object) -> tuple[FakeEngine, FakeEngine]:
    """Two members that disagree now and then, so the ensemble's answer is neither member's alone."""
    return (FakeEngine("a", script="the cat sat on the mat", sharpness=3.0, **kw),  # type: ignore[arg-type]
            FakeEngine("b", script="the cat sit in a hat!", sharpness=3.0, **kw))  # type: ignore[arg-type]


def prompt(e: FakeEngine, **kw: object) -> GenerationRequest:
    return GenerationRequest(e.tokenizer.encode("q:"), SamplingParams(**kw))  # type: ignore[arg-type]


@pytest.mark.parametrize("lead", [0, 1])
async def test_speculative_equals_full_token_for_token(lead: int) -> None:
    a, b = scripted()
    weights = [0.45, 0.55]
    want = await LogitAverage([a, b], Mixing(weights=weights)).generate(prompt(a, temperature=0, max_tokens=30))
    spec = LogitAverage([a, b], Mixing(weights=weights, mode="speculative", lead=lead, k=4))
    got = await spec.generate(prompt(a, temperature=0, max_tokens=30))
    assert got.choices[0].token_ids == want.choices[0].token_ids
    st = spec.tally
    assert st.accepted > 0 and st.proposed > st.accepted
    if lead == 0:  # a drafts its own text, the ensemble says b's: drafts are rejected and rolled back
        assert sum(st.rolled_back) > 0
    assert st.positions == len(got.choices[0].token_ids)
    # sampling with a seed: the same draws, so the same tokens as full averaging
    for seed in (1, 2, 3):
        sampled = await LogitAverage([a, b], Mixing(weights=weights)).generate(prompt(a, temperature=1.0, seed=seed, max_tokens=30))
        spec_s = await LogitAverage([a, b], Mixing(weights=weights, mode="speculative", lead=lead, k=3)).generate(
            prompt(a, temperature=1.0, seed=seed, max_tokens=30))
        assert spec_s.choices[0].token_ids == sampled.choices[0].token_ids
    assert a.active_sessions == b.active_sessions == 0


async def test_speculative_saves_the_other_members_forwards() -> None:
    a, b = FakeEngine("a", script="abcdefghijklmnop"), FakeEngine("b", script="abcdefghijklmnop")
    spec = LogitAverage([a, b], Mixing(mode="speculative", k=4))
    out = await spec.generate(prompt(a, temperature=0, max_tokens=16))
    assert out.choices[0].text == "abcdefghijklmnop"
    assert b.steps <= 1 + 16 // 4 + 1  # its prefill, then one forward per round of 4
    assert spec.tally.accepted >= 12 and sum(spec.tally.rolled_back) == 0


async def test_selective_consults_only_where_the_lead_is_unsure() -> None:
    a, b = scripted()
    lead_alone = await a.generate(prompt(a, temperature=0, max_tokens=30))
    never = LogitAverage([a, b], Mixing(weights=[0.45, 0.55], mode="selective", gate=0.01))
    got = await never.generate(prompt(a, temperature=0, max_tokens=30))
    assert got.choices[0].token_ids == lead_alone.choices[0].token_ids
    assert never.tally.consulted == 0 and never.tally.prompted == [True, False] and b.active_sessions == 0
    every = LogitAverage([a, b], Mixing(weights=[0.45, 0.55], mode="selective", gate=1.0))  # top-1 below 1: always unsure
    fully = await LogitAverage([a, b], Mixing(weights=[0.45, 0.55])).generate(prompt(a, temperature=0, max_tokens=30))
    assert (await every.generate(prompt(a, temperature=0, max_tokens=30))).choices[0].token_ids == \
        fully.choices[0].token_ids
    assert every.tally.consulted == every.tally.positions


class Moody(FakeEngine):
    """A fake whose confidence changes with the step: sure on most steps, unsure on every third."""

    @property  # type: ignore[override]
    def sharpness(self) -> float:
        return 1.0 if self.steps % 3 == 0 else 12.0

    @sharpness.setter
    def sharpness(self, value: float) -> None:
        pass


async def test_selective_catch_up_is_one_forward_and_exact() -> None:
    """A member consulted after a gap reads the missed tokens in one forward; the ensemble's answer is the one
    where that member stepped every token (full averaging at exactly the consulted positions)."""
    a, b = Moody("a", script="the cat sat on the mat"), FakeEngine("b", script="the cat sit in a hat!", sharpness=3.0)
    sometimes = LogitAverage([a, b], Mixing(weights=[0.3, 0.7], mode="selective", gate=0.5))
    b_steps = b.steps
    out = await sometimes.generate(prompt(a, temperature=0, max_tokens=30))
    st = sometimes.tally
    assert 0 < st.consulted < st.positions
    assert b.steps - b_steps == st.consulted  # one forward per consultation, whatever the gap
    assert st.catch_up[1] == st.fed[1] > st.consulted  # several tokens per catch-up
    text = out.choices[0].text
    assert text != "the cat sat on the mat" and text != "the cat sit in a hat!"  # some positions went to b
    assert b.active_sessions == 0


def test_gates() -> None:
    sure, unsure = torch.tensor([10.0, 0.0, 0.0]), torch.tensor([1.0, 1.0, 1.0])
    assert not uncertain(sure, "top1", 0.5) and uncertain(unsure, "top1", 0.5)
    assert not uncertain(sure, "entropy", 0.5) and uncertain(unsure, "entropy", 1.0)  # log 3 = 1.0986 nats


def test_http_modes_trace_usage_and_prompt_ensembles(client: openai.OpenAI, server) -> None:  # type: ignore[no-untyped-def]
    """Over the API: modes give full averaging's answer, the trace reports what each did, a member with its
    own system prompt reads its own prompt."""
    def ask(**ens: object) -> openai.types.chat.ChatCompletion:
        return client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=12, temperature=0,
            extra_body={"ensemble": {"strategy": "logit_average", "members": ["fake", "fake"], "trace": True, **ens}})

    base = ask()
    spec = ask(mode="speculative", k=3)
    sel = ask(mode="selective", gate=0.05)
    assert spec.choices[0].message.content == base.choices[0].message.content == sel.choices[0].message.content
    te = spec.model_extra["ensemble"]["token_ensemble"]
    assert te["mode"] == "speculative" and te["acceptance"] > 0.5 and te["ensembled_share"] == 1.0
    sel_trace = sel.model_extra["ensemble"]
    assert sel_trace["token_ensemble"]["consulted"] == 0
    assert sel_trace["usage_by_member"]["fake#2"]["total_tokens"] == 0  # never consulted: never ran
    persona = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0,
        extra_body={"ensemble": {"strategy": "logit_average", "trace": True,
                                 "members": ["fake", {"model": "fake", "system": "You are a pirate."}]}})
    by = persona.model_extra["ensemble"]["usage_by_member"]
    assert by["fake#2"]["prompt_tokens"] > by["fake"]["prompt_tokens"]  # the pirate read its own, longer prompt
    import httpx

    metrics = httpx.get(server.url + "/metrics").text
    for name in ("chorus_token_ensemble_positions_total", "chorus_token_ensemble_consulted_total",
                 "chorus_speculative_proposed_total", "chorus_speculative_accepted_total"):
        assert name in metrics


@pytest.mark.parametrize("mode", ["selective", "speculative"])
def test_disconnect_mid_stream_frees_every_member(server, fakes, mode: str) -> None:  # type: ignore[no-untyped-def]
    import httpx

    from tests.helpers import wait_until

    slow = fakes["slow"]
    extra = {"gate": 1.0} if mode == "selective" else {"k": 3}
    body = {"model": "slow", "messages": [{"role": "user", "content": "a"}], "max_tokens": 5000, "stream": True,
            "ensemble": {"strategy": "logit_average", "members": ["slow", "slow"], "mode": mode, **extra}}
    steps0 = slow.steps
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
    assert wait_until(lambda: slow.active_sessions == 0), slow.active_sessions
    assert slow.steps - steps0 < 200  # cancelled, not run to 5000 tokens


async def test_a_dropped_member_leaves_the_others_even_with_zero_weight() -> None:
    """skip: the member with all the weight fails; the one left (weight 0) carries on alone, not NaN."""
    good, bad = FakeEngine("good", script="hello"), FakeEngine("bad", script="zzzzzzzz", fail_after=2)
    dropped: list[str] = []
    ens = LogitAverage([good, bad], Mixing(weights=[0, 1]), skip=True, on_drop=lambda label, _: dropped.append(label))
    out = await ens.generate(prompt(good, temperature=0, max_tokens=8))
    assert dropped == ["bad"] and out.choices[0].text.endswith("llo")
