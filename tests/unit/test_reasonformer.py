"""ReasonFormer on a tiny random Llama: exactness at the start, cached decode, batching rows of different
depths, options, routing / gate, checkpoint round trip and the two training stages."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from chorus.engines.families.reasonformer import (
    Decision,
    ReasonFormerConfig,
    ReasonFormerModel,
    ReasonObserver,
    build_retrofit,
    check_options,
    load_base_model,
    load_reasonformer,
)
from chorus.engines.runtime.kv_cache import GrowingCache
from chorus.engines.transformers.batching import BatchRunner
from chorus.errors import BuildError, InvalidRequest


def base_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def tiny(base: Path, **kw: object) -> ReasonFormerModel:
    torch.manual_seed(0)
    opts: dict = {"representation": (0, 1), "block": (1, 3), "coda": (3, 5), "rank": 4, "adapter_rank": 2,
                  "alpha": 4.0, "router_dim": 16, "router_heads": 2, **kw}
    return ReasonFormerModel(load_base_model(base), ReasonFormerConfig(**opts)).eval()


def trained_like(model: ReasonFormerModel, gate_bias: float = 3.0) -> ReasonFormerModel:
    """Non-zero skills, a decisive router and open gates, as after training (fresh ones hide bugs)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for lora in model.loras:
            for b in lora.B:
                b.copy_(torch.randn(b.shape, generator=gen) * 0.3)
        for router in model.routers:
            router.out.weight.copy_(torch.randn(router.out.weight.shape, generator=gen))
        for gate in model.gates:
            gate.out.bias.fill_(gate_bias)
    return model.eval()


@pytest.mark.parametrize("kind,top_k", [("shared", 2), ("private", 1), ("shared", None)])
def test_one_step_with_fresh_skills_is_the_base(base: Path, ids: torch.Tensor, kind: str, top_k: int | None) -> None:
    model = tiny(base, kind=kind, top_k=top_k, representation=(0, 2), block=(2, 3), coda=(3, 5))
    with torch.no_grad():
        got = model(ids, max_steps=1).logits
        fresh_default = model(ids).logits  # fresh gates are closed: the cascade stops after step 1
    want = base_logits(base, ids)
    assert torch.equal(got, want)
    assert torch.equal(fresh_default, want)
    assert all(d.depth == 1 and d.stop_gate is not None and d.stop_gate < 0.5 for d in model.reports)


def test_cached_decode_equals_full_forward_and_keeps_the_prompt_decision(base: Path, ids: torch.Tensor) -> None:
    model = trained_like(tiny(base, max_steps=3))
    seq = ids[:1]
    with torch.no_grad():
        prompt = model(seq).logits[0]
        decision = model.reports[0]
    assert decision.depth == 3 and len(decision.skills[0]) == 2
    # decoding token by token with the prompt's decision reproduces a full forward under that decision
    from chorus.engines.families.reasonformer import RowControl

    with torch.no_grad():
        model.controls = [RowControl(3, 0.5, decision)]
        full = model(seq).logits[0]
        cache, steps = GrowingCache(), []
        for i in range(seq.shape[1]):
            mask = torch.ones(1, 1, 1, i + 1, dtype=torch.bool)
            steps.append(model(seq[:, i: i + 1], attention_mask=mask, position_ids=torch.tensor([[i]]),
                               cache=cache).logits[0, -1])
        model.controls = None
    assert torch.allclose(full, prompt, atol=1e-5)  # the same decision again
    assert len(cache.layers) == 1 + 2 + 3 * 2 * 2  # representation + coda + steps x top_k x block layers
    assert (torch.stack(steps) - full).abs().max() < 1e-4


def test_gate_threshold_and_max_steps_set_the_depth(base: Path, ids: torch.Tensor) -> None:
    model = trained_like(tiny(base, max_steps=3), gate_bias=0.0)  # gates near 0.5
    with torch.no_grad():
        model(ids)
        gates = [d.gates[1] if d.depth > 1 else d.stop_gate for d in model.reports]
        assert all(g is not None and 0.2 < g < 0.8 for g in gates)
        from chorus.engines.families.reasonformer import RowControl

        model.controls = [RowControl(3, 0.0), RowControl(3, 1.0)]
        model(ids)
        assert [d.depth for d in model.reports] == [3, 1]  # threshold 0: never stops; 1: stops at once
        model.controls = [RowControl(2, 0.0), RowControl(1, 0.0)]
        model(ids)
        assert [d.depth for d in model.reports] == [2, 1]
        assert model.reports[1].stop_gate is None  # capped, not stopped by its gate
        model.controls = None


def test_router_picks_skills_and_weights_sum_to_one(base: Path, ids: torch.Tensor) -> None:
    model = trained_like(tiny(base, top_k=2))
    with torch.no_grad():
        model.routers[0].out.bias.copy_(torch.tensor([0.0, 0.0, 9.0, 8.0]))
        model.routers[0].out.weight.zero_()
        model(ids, max_steps=1)
    for d in model.reports:
        assert d.skills[0] == [2, 3]
        assert abs(sum(d.weights[0]) - 1) < 1e-6 and d.weights[0][0] > d.weights[0][1]


@pytest.mark.parametrize("options,needle", [
    ({"max_steps": 0}, "max_steps"), ({"max_steps": 4}, "max_steps"), ({"max_steps": True}, "max_steps"),
    ({"stop_threshold": 1.5}, "stop_threshold"), ({"stop_threshold": "x"}, "stop_threshold"),
    ({"recurrence": 2}, "recurrence"), ({"exit": {"kl": 1.0}}, "exit"),
])
def test_bad_options(options: dict, needle: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        check_options(options, ReasonFormerConfig.retrofit(10), "rf")
    assert err.value.param == needle
    if needle in ("recurrence", "exit"):
        assert "MoDr" in str(err.value)


@pytest.mark.parametrize("opts,needle", [
    ({"top_k": 5}, "top_k"), ({"max_steps": 0}, "max_steps"), ({"kind": "public"}, "kind"),
    ({"skills": ("a", "a")}, "distinct"), ({"stop_threshold": 2.0}, "stop_threshold"), ({"block": (3, 6)}, "block"),
    ({"router_dim": 10, "router_heads": 4}, "router_dim"),
])
def test_bad_settings(opts: dict, needle: str) -> None:
    cfg = ReasonFormerConfig(**{"representation": (0, 1), "block": (1, 3), "coda": (3, 5), **opts})
    with pytest.raises(BuildError, match=needle):
        cfg.check(5)


def test_from_options_refuses_unknown_and_partial_ranges() -> None:
    with pytest.raises(BuildError, match="unknown ReasonFormer settings"):
        ReasonFormerConfig.from_options(30, {"skils": ["a"]})
    with pytest.raises(BuildError, match="all three"):
        ReasonFormerConfig.from_options(30, {"block": [3, 5]})
    cfg = ReasonFormerConfig.from_options(30, {"skills": ["a", "b"], "top_k": 1})
    assert (cfg.representation, cfg.block, cfg.coda, cfg.skills) == ((0, 12), (12, 18), (18, 30), ("a", "b"))


async def run_session(runner: BatchRunner, prompt: list[int], tokens: list[int], options: dict,
                      n: int = 1) -> tuple[list, list]:
    sessions = runner.open_many(n, options)
    out = [await runner.submit_prefill(sessions, prompt)]
    for t in tokens:
        out.append(await sessions[0].step(t))
    fams = [s.family for s in sessions]
    for s in sessions:
        s.close()
    return out, fams


async def test_batched_rows_of_different_depths_equal_alone(base: Path) -> None:
    """Sequences that stopped at different depths share the runner's decode forwards; each gets what it gets
    alone, keeps its prompt's decision, and the n choices of a prompt share it."""
    model = trained_like(tiny(base, max_steps=3))
    obs = ReasonObserver(model)
    runner = BatchRunner(model, max_model_len=128, observer=obs)
    a = ([5, 6, 7, 8], [9, 10, 11, 12, 13], {"max_steps": 1})
    b = ([20, 21, 22], [23, 24, 25, 26, 27], {"stop_threshold": 0.0})
    try:
        alone_a = await run_session(runner, *a)
        alone_b = await run_session(runner, *b, n=2)
        both = await asyncio.gather(run_session(runner, *a), run_session(runner, *b, n=2))
    finally:
        await runner.stop()
    for alone, together in ((alone_a, both[0]), (alone_b, both[1])):
        assert max(float((x - y).abs().max()) for x, y in zip(alone[0], together[0])) < 1e-4
    fa, fb = both[0][1], both[1][1]
    assert fa[0].depth == 1 and fb[0].depth == 3 and fb[1] is fb[0]
    assert obs.sequences == 4 and obs.steps_total == 2 * (1 + 3)
    assert abs(sum(obs.weight_sums) - obs.steps_total) < 1e-4  # each step's weights sum to 1
    trace = obs.trace([])
    assert trace["reasonformer"]["choices"] == []
    names = [m[0] for m in obs.metrics()]
    assert names[:2] == ["chorus_reasonformer_skill_weight_sum", "chorus_reasonformer_steps_total"]


def test_checkpoint_round_trip(base: Path, tmp_path: Path, ids: torch.Tensor) -> None:
    out = build_retrofit(base, tmp_path / "rf", {"representation": [0, 1], "block": [1, 3], "coda": [3, 5],
                                                 "router_dim": 16, "router_heads": 2, "kind": "private"},
                         log=lambda _: None)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "chorus_reasonformer" and config["reasonformer"]["kind"] == "private"
    loaded = load_reasonformer(out)
    with torch.no_grad():
        assert torch.equal(loaded(ids, max_steps=1).logits, base_logits(base, ids))
    with pytest.raises(BuildError, match="not a ReasonFormer checkpoint"):
        load_reasonformer(base)
    with pytest.raises(BuildError, match="exists"):
        build_retrofit(base, out, {}, log=lambda _: None)


def test_decision_depth() -> None:
    assert Decision().depth == 0 and Decision(skills=[[0], [1]]).depth == 2


def test_mc_rows_read_as_their_answer_and_row_slices(tmp_path: Path) -> None:
    from chorus.training.data import parse_rows, read_texts

    data = tmp_path / "mc.jsonl"
    data.write_text("\n".join(json.dumps({"goal": f"g{i}", "choices": ["a", "b"], "label": i % 2}) for i in range(6))
                    + "\n" + json.dumps({"context": "A man", "choices": ["runs.", "sits."], "label": 1}) + "\n")
    path, rows = parse_rows(f"{data}@2:4")
    assert read_texts(path, rows) == ["Question: g2\nAnswer: a", "Question: g3\nAnswer: b"]
    assert read_texts(data)[-1] == "A man sits."
    with pytest.raises(BuildError, match="START:END"):
        parse_rows(f"{data}@x")


def test_two_stage_training_and_the_plain_lora_baseline(base: Path, tmp_path: Path, tokenized_base: Path) -> None:
    """Stage 1 (each skill on its own data) and stage 2 (router, gates, skills on mixed data) lower the held-out
    loss; the router learns to tell the two tasks apart; the baseline merges into a dense checkpoint that loads
    as a plain model."""
    from chorus.training.reasonformer import TrainConfig, train_plain_lora, train_reasonformer

    tbase = tokenized_base
    words = "the cat sat on the mat and the dog sat on the log".split()
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": " ".join(words[i % 4:] + words[: i % 4])})
                                               for i in range(40)))
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"question": f"{i} + {i}?", "answer": str(2 * i)})
                                               for i in range(40)))
    skills = {"words": str(tmp_path / "a.jsonl"), "sums": str(tmp_path / "b.jsonl")}
    opts = {"representation": [0, 1], "block": [1, 3], "coda": [3, 5], "rank": 4, "adapter_rank": 2,
            "router_dim": 16, "router_heads": 2, "top_k": 2, "max_steps": 2}
    tc = TrainConfig(stage1_steps=15, stage2_steps=25, batch_size=4, seq_len=24, lr=1e-2, eval_rows=6, log_every=100)
    summary = train_reasonformer(tbase, skills, tmp_path / "rf", tc, options=opts, log=lambda _: None)
    for skill in skills:
        assert summary["after"][skill]["loss"] < summary["before"][skill]["loss"] - 0.3  # a tiny random base
    routed = [summary["after"][s]["router"] for s in skills]  # mean step-1 weight per skill, on each task's data
    assert routed[0] != routed[1]
    loaded = load_reasonformer(tmp_path / "rf")
    assert loaded.cfg.skills == ("words", "sums")
    with pytest.raises(BuildError, match="skills"):
        train_reasonformer(tmp_path / "rf", {"sums": skills["sums"]}, tmp_path / "again", tc, log=lambda _: None)
    base_summary = train_plain_lora(tbase, skills, tmp_path / "lora", tc, rank=4, options=opts, log=lambda _: None)
    assert base_summary["steps"] == 2 * 15 + 25
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "lora")
    assert type(merged).__name__ == "LlamaForCausalLM"
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert (merged(ids).logits - base_logits(tbase, ids)).abs().max() > 1e-3  # the LoRA is in the weights
