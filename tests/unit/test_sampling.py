import torch

from chorus.engines.core.base import SamplingParams
from chorus.engines.core.sampling import apply_penalties, filter_logits, kept, logprob_info, make_generator, sample

logits = torch.tensor([1.0, 3.0, 2.0, 0.5, -1.0])


def draws(params: SamplingParams, seed: int, k: int = 50) -> list[int]:
    g = make_generator(seed)
    return [sample(logits, params, g) for _ in range(k)]


def test_greedy_takes_argmax() -> None:
    assert sample(logits, SamplingParams(temperature=0), make_generator(0)) == 1


def test_same_seed_same_draws_other_seed_other_draws() -> None:
    p = SamplingParams(temperature=1.5)
    assert draws(p, 7) == draws(p, 7)
    assert draws(p, 7) != draws(p, 8)


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    assert set(draws(SamplingParams(top_k=1), 1)) == {1}
    assert set(draws(SamplingParams(top_p=0.01), 1)) == {1}


def test_top_k_limits_support() -> None:
    assert set(draws(SamplingParams(temperature=2.0, top_k=2), 3, 200)) <= {1, 2}


def test_top_p_keeps_the_nucleus() -> None:
    probs = torch.softmax(logits, -1)  # sorted: 1 (.63), 2 (.23), 0 (.09), ...
    x = filter_logits(logits, SamplingParams(top_p=0.8))
    kept = {i for i in range(5) if x[i] > float("-inf")}
    assert kept == {1, 2}
    assert probs[1] < 0.8 <= probs[1] + probs[2]


def test_penalties_lower_repeated_tokens() -> None:
    out = apply_penalties(logits, {1: 3}, SamplingParams(frequency_penalty=1.0, presence_penalty=0.5))
    assert float(out[1]) == 3.0 - 3.0 - 0.5
    assert torch.equal(out[[0, 2, 3, 4]], logits[[0, 2, 3, 4]])


def test_logprobs_are_of_the_model_distribution() -> None:
    lp, top = logprob_info(logits, 2, 2)
    ref = torch.log_softmax(logits, -1)
    assert abs(lp - float(ref[2])) < 1e-6
    assert [i for i, _ in top] == [1, 2]


def test_kept_is_the_filtered_support_with_its_probabilities() -> None:
    """`kept` (top 64 / 512 by topk, else one sort) keeps exactly what `filter_logits` keeps, with the softmax of
    the filtered logits as probabilities, for a peaked and a flat distribution over a 49k vocabulary."""
    g = torch.Generator().manual_seed(0)
    for scale in (8.0, 1.0):  # a real model's peaked next-token distribution; a flat one (thousands kept)
        x = torch.randn(49152, generator=g) * scale
        for params in (SamplingParams(top_p=0.9), SamplingParams(temperature=0.2, top_p=0.9),
                       SamplingParams(temperature=0.7, top_k=40, top_p=0.95), SamplingParams(top_p=0.5),
                       SamplingParams(temperature=1.3)):
            ids, probs = kept(x, params)
            f = filter_logits(x, params)
            assert set(ids.tolist()) == set(torch.nonzero(f > float("-inf")).flatten().tolist())
            ref = torch.softmax(f, -1)[ids]
            assert torch.allclose(probs, ref, atol=1e-6) and abs(float(probs.sum()) - 1) < 1e-5


def test_draws_follow_the_kept_probabilities() -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95)
    ids, probs = kept(logits, params)
    n = 20000
    counts = torch.bincount(torch.tensor(draws(params, 5, n)), minlength=5).double() / n
    expected = torch.zeros(5, dtype=torch.float64)
    expected[ids] = probs.double()
    assert torch.allclose(counts, expected, atol=0.015)
