import pytest
import torch

from chorus.engines.core.base import GenerationRequest, SamplingParams
from chorus.engines.fake.engine import FakeEngine
from chorus.ensembles.base import STRATEGIES, register, strategy_class
from chorus.ensembles.logit_average.mixing import Mixing
from chorus.ensembles.logit_average.strategy import LogitAverage, LogitAverageStrategy
from chorus.errors import CapabilityMismatch, InvalidRequest


def req(e: FakeEngine, **kw) -> GenerationRequest:
    return GenerationRequest(e.tokenizer.encode("x"), SamplingParams(temperature=0, **kw))


async def test_weights_select_a_member() -> None:
    a, b = FakeEngine("a", script="alpha"), FakeEngine("b", script="bravo")
    for weights, want in (([1, 0], "alpha"), ([0, 1], "bravo"), ([3, 1], "alpha")):
        g = await LogitAverage([a, b], Mixing(weights=weights)).generate(req(a))
        assert g.choices[0].text == want
    assert a.active_sessions == b.active_sessions == 0


async def test_self_average_equals_the_single_model() -> None:
    a = FakeEngine("a", sharpness=2.0)
    single = await a.generate(req(a, max_tokens=10))
    for space in ("probability", "logit"):
        ens = await LogitAverage([a, a], Mixing(space=space)).generate(req(a, max_tokens=10))
        assert ens.choices[0].token_ids == single.choices[0].token_ids


async def test_combination_in_each_space() -> None:
    la = LogitAverage([FakeEngine("a"), FakeEngine("b")], Mixing(weights=[1, 3]))
    z1, z2 = torch.tensor([0.0, 2.0, 1.0]), torch.tensor([1.0, 0.0, 3.0])
    s = la.open_session()
    s.vocab = 3
    p = 0.25 * torch.softmax(z1, -1) + 0.75 * torch.softmax(z2, -1)
    assert torch.allclose(torch.softmax(s.combine([z1, z2]), -1), p, atol=1e-6)
    s.space = "logit"
    assert torch.allclose(s.combine([z1, z2]), 0.25 * z1 + 0.75 * z2)
    s.close()


def test_bad_ensembles_are_refused() -> None:
    a = FakeEngine("a")
    with pytest.raises(InvalidRequest, match="at least 2"):
        LogitAverage([a])
    with pytest.raises(InvalidRequest, match="weights"):
        LogitAverage([a, a], Mixing(weights=[1, -1]))
    with pytest.raises(InvalidRequest, match="space"):
        LogitAverage([a, a], Mixing(space="median"))
    other = FakeEngine("other")
    other.tokenizer.vocab = list(other.tokenizer.vocab)  # a different vocabulary
    other.tokenizer.vocab[0] = "~~"
    with pytest.raises(CapabilityMismatch, match="other differ from a.*topk_union"):
        LogitAverage([a, other])


def test_registry() -> None:
    assert strategy_class("logit_average") is LogitAverageStrategy
    with pytest.raises(
        InvalidRequest,
        match="Valid strategies: answer_vote, cascade, choice_average, consistency_select, crowd_vote, exchange_of_thought, logit_average",
    ):
        strategy_class("nope")
    with pytest.raises(ValueError, match="already registered"):
        register("logit_average", "x:Y")
    register("logit_average", STRATEGIES["logit_average"])  # the same target again is fine (config reloads)


def test_the_trace_has_each_tokens_member_agreement() -> None:
    """trace: the tokens of the answer, each with every member's probability of it (equal to the member's own
    logprob of that token when it answers alone), whether it was the member's top-1, and its top tokens."""
    import math

    from openai import OpenAI

    from tests.helpers import serve_fakes

    engines = {"a": FakeEngine("a", script="The answer is 42."), "b": FakeEngine("b", script="The answer is 42!")}
    with serve_fakes(engines, [{"name": "avg", "strategy": "logit_average", "members": ["a", "b"]}]) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="x")
        ask = {"messages": [{"role": "user", "content": "Q"}], "max_tokens": 30, "temperature": 0}
        r = client.chat.completions.create(model="avg", extra_body={"ensemble": {"trace": True}}, **ask)
        tokens = r.model_extra["ensemble"]["token_ensemble"]["tokens"]
        text = r.choices[0].message.content
        assert "".join(t["text"] for t in tokens) == text and text[:-1] == "The answer is 42"
        assert [t["agreement"] for t in tokens] == [1.0] * 16 + [0.5]  # a tie at the end: a says ".", b "!"
        assert tokens[-1]["top"]["b"][0][0] == "!" and tokens[-1]["top"]["a"][0][0] == "."
        member = "a" if text.endswith(".") else "b"  # the one whose own answer is the ensemble's
        alone = client.chat.completions.create(model=member, logprobs=True, **ask)
        emitted = [lp for lp in alone.choices[0].logprobs.content if lp.token]  # the end-of-sequence token: ""
        for t, lp in zip(tokens, emitted, strict=True):
            assert t["text"] == lp.token and t["p"][member] == pytest.approx(math.exp(lp.logprob), abs=1e-5)
        # streamed: the same rows on the last chunk
        chunks = list(client.chat.completions.create(model="avg", stream=True, extra_body={"ensemble": {
            "trace": True}}, **ask))
        assert chunks[-1].model_extra["ensemble"]["token_ensemble"]["tokens"] == tokens
    assert engines["a"].active_sessions == engines["b"].active_sessions == 0
