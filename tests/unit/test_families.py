"""Model families on tiny random Llama presets: upcycling, grafting, MoDr (equivalences, cache, batching, training)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from chorus.engines.families.graft import GraftConfig, graft
from chorus.engines.families.modr import (
    MoDrConfig,
    MoDrModel,
    RoutingObserver,
    check_options,
    load_base_model,
    load_modr,
)
from chorus.engines.families.moe import ExpertLoad, UpcycleConfig, upcycle
from chorus.engines.runtime.kv_cache import GrowingCache
from chorus.engines.transformers.batching import BatchRunner
from chorus.errors import BuildError, InvalidRequest
from chorus.training.modr import TrainConfig, train_modr


def logits_of(path: Path, ids: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def no_leftovers(out: Path) -> bool:
    return not out.exists() and not list(out.parent.glob(f".{out.name}.tmp-*"))


# ---- MoE upcycling ----

@pytest.mark.parametrize("cfg", [
    UpcycleConfig(experts=4, top_k=2),
    UpcycleConfig(experts=3, top_k=1, router="hidden"),
    UpcycleConfig(experts=4, top_k=2, shared_expert=True),
    UpcycleConfig(experts=8, top_k=3, shared_expert=True, router="hidden"),
    UpcycleConfig(experts=4, top_k=2, layout="deepseek_v3"),
    UpcycleConfig(experts=6, top_k=3, layout="deepseek_v3", router="hidden"),
], ids=["mixtral", "mixtral-top1-hidden", "qwen2moe-shared", "qwen2moe-hidden", "deepseek-v3", "deepseek-v3-hidden"])
def test_upcycled_identical_experts_equal_the_dense_model(base: Path, ids: torch.Tensor, tmp_path: Path,
                                                          cfg: UpcycleConfig) -> None:
    out = upcycle(base, tmp_path / "moe", cfg, log=lambda _: None)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == cfg.model_type
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    load = ExpertLoad(model)
    load.before([])
    with torch.no_grad():
        got = model(ids).logits
    assert (got - logits_of(base, ids)).abs().max() < 1e-4
    counts = load.count(torch.arange(ids.numel()))
    assert counts.shape == (5, cfg.experts)
    assert (counts.sum(1) == ids.numel() * cfg.top_k).all()  # every token goes to k experts in every layer


def test_upcycle_hub_layout_and_noise(base: Path, ids: torch.Tensor, tmp_path: Path) -> None:
    out = upcycle(base, tmp_path / "moe", UpcycleConfig(experts=2, top_k=1, noise=0.5), log=lambda _: None)
    names = load_file(out / "model.safetensors")
    assert "model.layers.0.block_sparse_moe.experts.1.w2.weight" in names  # what vLLM and the hub use
    assert "model.layers.0.block_sparse_moe.gate.weight" in names
    assert (logits_of(out, ids) - logits_of(base, ids)).abs().max() > 1e-3  # noisy experts differ on purpose


@pytest.mark.parametrize(
    "cfg,needle",
    [
        (UpcycleConfig(experts=1, top_k=1), "--experts must be at least 2"),
        (UpcycleConfig(experts=4, top_k=5), "--top-k must be between 1 and --experts=4"),
        (UpcycleConfig(experts=4, top_k=2, noise=-1), "--noise"),
        (UpcycleConfig(experts=4, top_k=2, layout="deepseek_v4"), "--layout must be mixtral, qwen2_moe or deepseek_v3"),  # type: ignore[arg-type]
        (UpcycleConfig(experts=4, top_k=2, layout="deepseek_v3", shared_expert=True), "does not combine"),
    ],
)
def test_upcycle_bad_settings(base: Path, tmp_path: Path, cfg: UpcycleConfig, needle: str) -> None:
    with pytest.raises(BuildError, match=needle):
        upcycle(base, tmp_path / "out", cfg)
    assert no_leftovers(tmp_path / "out")


def test_builders_refuse_missing_and_foreign_checkpoints(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match="not a directory"):
        upcycle(tmp_path / "nope", tmp_path / "out", UpcycleConfig())
    foreign = tmp_path / "gemma"
    foreign.mkdir()
    (foreign / "config.json").write_text(json.dumps({"model_type": "gemma3_text", "num_hidden_layers": 4}))
    for build in (lambda: upcycle(foreign, tmp_path / "out", UpcycleConfig()),
                  lambda: graft(foreign, tmp_path / "out", GraftConfig(2))):
        with pytest.raises(BuildError, match="Llama-architecture.*gemma3_text"):
            build()
    empty = tmp_path / "noweights"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    with pytest.raises(BuildError, match="no \\*.safetensors"):
        graft(empty, tmp_path / "out", GraftConfig(1))
    assert no_leftovers(tmp_path / "out")


def test_existing_output_is_not_overwritten_without_force(base: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(BuildError, match="already exists"):
        graft(base, out, GraftConfig(1))
    assert (out / "keep.txt").read_text() == "mine"
    graft(base, out, GraftConfig(1), force=True, log=lambda _: None)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()


def test_a_failure_midway_leaves_no_output(base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import chorus.engines.families.graft as g

    def broken(*a: object, **k: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(g, "save_checkpoint", broken)
    with pytest.raises(OSError, match="disk full"):
        graft(base, tmp_path / "out", GraftConfig(1))
    assert no_leftovers(tmp_path / "out")


# ---- grafting ----

@pytest.mark.parametrize("drop", [1, 2, 4])
def test_graft_equals_mergekit_passthrough_slices(base: Path, tmp_path: Path, drop: int) -> None:
    """mergekit passthrough with slices [0, n-m] and [m, n] (half-open): layer j of the output is base layer
    j for j < n-m, else base layer m + (j - (n-m)); every other tensor is the base's."""
    out = graft(base, tmp_path / "g", GraftConfig(drop), log=lambda _: None)
    n = 5
    want_layers = 2 * (n - drop)
    src, got = load_file(base / "model.safetensors"), load_file(out / "model.safetensors")
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == want_layers
    for j in range(want_layers):
        i = j if j < n - drop else drop + (j - (n - drop))
        for name in [k for k in src if k.startswith(f"model.layers.{i}.")]:
            assert torch.equal(got[name.replace(f"layers.{i}.", f"layers.{j}.", 1)], src[name])
    assert all(torch.equal(got[k], v) for k, v in src.items() if not k.startswith("model.layers."))
    assert len(got) == len([k for k in src if not k.startswith("model.layers.")]) + want_layers * 9
    assert f"layer_range: [0, {n - drop}]" in (out / "mergekit.yaml").read_text()
    model = AutoModelForCausalLM.from_pretrained(out)  # transformers loads it unchanged
    assert model.config.num_hidden_layers == want_layers


@pytest.mark.parametrize("drop", [0, 5, -1])
def test_graft_bad_drop(base: Path, tmp_path: Path, drop: int) -> None:
    with pytest.raises(BuildError, match="--drop must be between 1 and 4"):
        graft(base, tmp_path / "g", GraftConfig(drop))
    assert no_leftovers(tmp_path / "g")


def test_cli_reports_bad_input_with_exit_code_2(base: Path, tmp_path: Path) -> None:
    out = tmp_path / "g"
    res = subprocess.run([sys.executable, "-m", "chorus", "graft", "--base", str(base), "--drop", "9",
                          "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--drop must be between 1 and 4" in res.stderr
    assert no_leftovers(out)
    res = subprocess.run([sys.executable, "-m", "chorus", "upcycle", "--base", str(base), "--experts", "4",
                          "--top-k", "2", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert json.loads((out / "config.json").read_text())["num_local_experts"] == 4


# ---- MoDr ----

def tiny_modr(base: Path, **kw: object) -> MoDrModel:
    torch.manual_seed(0)
    cfg = MoDrConfig(prelude=(0, 1), core=(1, 4), coda=(4, 5), rank=4, alpha=4.0, max_recurrence=8, **kw)
    return MoDrModel(load_base_model(base), cfg).eval()


def trained_like(model: MoDrModel) -> MoDrModel:
    """Non-zero branches and a decisive router, as after training (fresh branches would hide routing bugs)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for lora in model.loras:
            lora.B.copy_(torch.randn(lora.B.shape, generator=gen) * 0.3)
        model.router.weight.copy_(torch.randn(model.router.weight.shape, generator=gen))
    return model.eval()  # eval() drops cached fused copies of the branch weights


def test_modr_one_recurrence_with_fresh_branches_is_the_base(base: Path, ids: torch.Tensor) -> None:
    model = tiny_modr(base)
    with torch.no_grad():
        got = model(ids, recurrence=1).logits
    assert torch.equal(got, logits_of(base, ids))


@pytest.mark.parametrize("share", [None, 2])
def test_modr_cached_decode_equals_full_forward(base: Path, ids: torch.Tensor, share: int | None) -> None:
    model = trained_like(tiny_modr(base, kv_share=share))
    seq = ids[:1]
    with torch.no_grad():
        full = model(seq, recurrence=3, route_per_token=True).logits[0]  # (L, V)
        cache, steps = GrowingCache(), []
        for i in range(seq.shape[1]):
            mask = torch.ones(1, 1, 1, i + 1, dtype=torch.bool)
            out = model(seq[:, i: i + 1], attention_mask=mask, position_ids=torch.tensor([[i]]), cache=cache,
                        recurrence=3)
            steps.append(out.logits[0, -1])
            assert model.reports[0].steps == 3 and len(model.reports[0].branches) == 3
    slots = 3 if share is None else share
    assert len(cache.layers) == 1 + 1 + 3 * slots  # prelude + coda + core x step slots
    if share is None:
        assert (torch.stack(steps) - full).abs().max() < 1e-4
    else:  # sharing slots changes what later tokens read: a different (cheaper) model, still finite
        assert torch.isfinite(torch.stack(steps)).all()


def test_modr_routing_changes_outputs_and_bias_moves_choice(base: Path, ids: torch.Tensor) -> None:
    model = trained_like(tiny_modr(base))
    with torch.no_grad():
        model(ids, recurrence=2)
        first = model.reports[0].branches
        model.router_bias.fill_(0)
        model.router_bias[(first[0] + 1) % 4] = 10.0  # the bias alone picks the branch
        model(ids, recurrence=2)
    assert all(b == (first[0] + 1) % 4 for rep in model.reports for b in rep.branches)


@pytest.mark.parametrize("options,needle", [
    ({"recurrence": 0}, "recurrence"), ({"recurrence": 99}, "recurrence"), ({"recurrence": "3"}, "recurrence"),
    ({"exit": {"kl": -1}}, "exit"), ({"exit": {"entropy": 1}}, "exit"), ({"exit": 5}, "exit"),
])
def test_modr_bad_options(options: dict, needle: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        check_options(options, MoDrConfig.tiny(5))
    assert err.value.param == needle


async def run_session(runner: BatchRunner, prompt: list[int], tokens: list[int], options: dict) -> tuple[list, object]:
    (s,) = runner.open_many(1, options)
    out = [await runner.submit_prefill([s], prompt)]
    for t in tokens:
        out.append(await s.step(t))
    fam = s.family
    s.close()
    return out, fam


async def test_modr_batched_rows_with_different_recurrence_equal_alone(base: Path) -> None:
    """Two sequences with different recurrence counts (and exit) share the runner's steps; each gets what it
    gets alone, and the trace records its own steps per token."""
    import asyncio

    model = trained_like(tiny_modr(base))
    runner = BatchRunner(model, max_model_len=128, observer=RoutingObserver(model))
    a = ([5, 6, 7, 8], [9, 10, 11, 12, 13], {"recurrence": 2})
    b = ([20, 21, 22], [23, 24, 25, 26, 27], {"recurrence": 4})
    try:
        alone_a = await run_session(runner, *a)
        alone_b = await run_session(runner, *b)
        both = await asyncio.gather(run_session(runner, *a), run_session(runner, *b))
    finally:
        await runner.stop()
    for alone, together in ((alone_a, both[0]), (alone_b, both[1])):
        assert max(float((x - y).abs().max()) for x, y in zip(alone[0], together[0])) < 1e-4
    fam_a, fam_b = both[0][1], both[1][1]
    assert [r.steps for r in fam_a["tokens"]] == [2] * 5 and [r.steps for r in fam_b["tokens"]] == [4] * 5
    assert fam_a["prompt"][0].steps == 2


async def test_modr_adaptive_exit_uses_fewer_steps(base: Path) -> None:
    model = trained_like(tiny_modr(base))
    obs = RoutingObserver(model)
    runner = BatchRunner(model, max_model_len=128, observer=obs)
    try:
        _, loose = await run_session(runner, [5, 6, 7], [8, 9, 10, 11], {"recurrence": 6, "exit": {"kl": 1e9}})
        _, strict = await run_session(runner, [5, 6, 7], [8, 9, 10, 11], {"recurrence": 6, "exit": {"kl": 1e-30}})
    finally:
        await runner.stop()
    assert [r.steps for r in loose["tokens"]] == [2] * 4  # stops as soon as two steps can be compared
    assert [r.steps for r in strict["tokens"]] == [6] * 4
    assert obs.tokens_total == 8 and obs.steps_total == 32
    assert sum(obs.branch_totals) == 2 * 6 + 8 + 24  # two prompts x 6 steps, then one decision per token step
    trace = obs.trace([])
    assert trace["modr"]["choices"] == []


def test_modr_checkpoint_round_trip_and_training_lowers_loss(base: Path, tmp_path: Path, tokenized_base: Path) -> None:
    words = "the cat sat on the mat and the dog sat on the log while the bird sang in the tree".split()
    rows = [{"text": " ".join(words[i % 5:] + words[: i % 5])} for i in range(60)]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    # the tiny base has no tokenizer of its own: borrow a byte-level one only if present, else skip
    tbase = tokenized_base
    summary = train_modr(tbase, data, tmp_path / "modr", TrainConfig(steps=25, batch_size=4, seq_len=16, lr=3e-3,
                                                                     mean_recurrence=2, bptt=1, log_every=100),
                         modr={"prelude": (0, 1), "core": (1, 4), "coda": (4, 5), "rank": 4, "alpha": 4.0,
                               "max_recurrence": 8}, log=lambda _: None)
    assert summary["loss_after"] < summary["loss_before"] - 0.5
    assert sum(summary["branch_usage"]) > 0
    loaded = load_modr(tmp_path / "modr")
    assert loaded.cfg.core == (1, 4) and any(float(l.B.abs().sum()) > 0 for l in loaded.loras)
    assert float(loaded.router_bias.abs().sum()) > 0  # the balancing update moved the bias


def _moe_config(kind: str) -> object:
    import transformers as tf

    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, intermediate_size=96)
    mla = dict(num_key_value_heads=4, moe_intermediate_size=48, n_routed_experts=4, num_experts_per_tok=2,
               n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1, q_lora_rank=None,
               kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
    return {
        "mixtral": lambda: tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2),
        "qwen2_moe": lambda: tf.Qwen2MoeConfig(**common, moe_intermediate_size=48, shared_expert_intermediate_size=96,
                                               num_experts=4, num_experts_per_tok=2),
        "olmoe": lambda: tf.OlmoeConfig(**common, num_experts=4, num_experts_per_tok=2),
        "deepseek_v2": lambda: tf.DeepseekV2Config(**{**common, **mla}),
        "deepseek_v3": lambda: tf.DeepseekV3Config(**{**common, **mla}),
        "glm4_moe": lambda: tf.Glm4MoeConfig(**common, moe_intermediate_size=48, n_routed_experts=4,
                                             num_experts_per_tok=2, first_k_dense_replace=0),
    }[kind]()


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe"])
async def test_moe_classes_serve_through_the_batching_engine(kind: str) -> None:
    """transformers' MoE classes (tiny random configs): cached decode in chorus's runner equals a full forward,
    and every token is counted k times per layer in the expert load."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_moe_config(kind), attn_implementation="sdpa").eval()
    load = ExpertLoad(model)
    runner = BatchRunner(model, max_model_len=128, observer=load)
    try:
        (s,) = runner.open_many(1)
        prompt, fed = [5, 6, 7, 8, 9], [10, 11, 12]
        outs = [await runner.submit_prefill([s], prompt)] + [await s.step(t) for t in fed]
        with torch.no_grad():
            full = model(torch.tensor([prompt + fed])).logits[0]
        assert max(float((o - full[len(prompt) - 1 + i]).abs().max()) for i, o in enumerate(outs)) < 1e-4
        assert (load.layers, load.experts) == (2, 4)
        assert s.family.sum(1).tolist() == [2 * 8, 2 * 8]
        s.close()
    finally:
        await runner.stop()
