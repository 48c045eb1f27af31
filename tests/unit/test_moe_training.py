"""MoE training: the Switch / GShard / DeepSeek routers, the MoE layer against transformers' own blocks per
layout, the shared balancing code, and `chorus train moe` end to end on a tiny base."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from chorus.engines.families.balance import BiasBalancer, load_stats, router_z_loss, switch_aux_loss
from chorus.engines.families.checkpoint import tiny_llama
from chorus.engines.families.moe import ExpertLoad
from chorus.engines.families.moe_layer import MoELayer
from chorus.engines.families.moe_routing import (
    DeepSeekRouter,
    GShardRouter,
    LayoutRule,
    SwitchRouter,
    capacity_limit,
)
from chorus.errors import BuildError
from chorus.training.moe import MoeTrainConfig, train_moe
from tests.helpers import prepared_model_dir

COMMON = dict(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, intermediate_size=48)


def _config(layout: str, k: int, **extra: Any) -> Any:
    if layout == "mixtral":
        return tf.MixtralConfig(**COMMON, num_local_experts=6, num_experts_per_tok=k, **extra)
    if layout == "qwen2_moe":
        return tf.Qwen2MoeConfig(**COMMON, moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=6,
                                 num_experts_per_tok=k, **extra)
    moe = dict(moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=k, n_shared_experts=1,
               first_k_dense_replace=0, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    if layout == "deepseek_v3":
        return tf.DeepseekV3Config(
            **{**COMMON, **moe, "num_key_value_heads": 4, **extra},
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        )
    return tf.Glm4MoeConfig(**{**COMMON, **moe, **extra})


def _block(config: Any) -> Any:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    block = model.model.layers[0].mlp
    with torch.no_grad():  # transformers starts some routers at zero: give every tensor a distinct value
        for p in block.parameters():
            p.normal_(0, 0.3)
        if hasattr(block.gate, "e_score_correction_bias"):
            block.gate.e_score_correction_bias.normal_(0, 0.5)
    return block


@pytest.mark.parametrize("layout,router,k,extra", [
    ("mixtral", "switch", 1, {}),
    ("mixtral", "gshard", 2, {}),
    ("qwen2_moe", "switch", 1, {"norm_topk_prob": False}),
    ("qwen2_moe", "gshard", 2, {"norm_topk_prob": True}),
    ("qwen2_moe", "gshard", 2, {"norm_topk_prob": False}),
    ("deepseek_v3", "deepseek", 3, {}),
    ("deepseek_v3", "deepseek", 2, {"norm_topk_prob": False}),
    ("glm4_moe", "deepseek", 3, {}),
])
def test_inference_forward_equals_the_transformers_block(layout: str, router: str, k: int, extra: dict) -> None:
    config = _config(layout, k, **extra)
    block = _block(config)
    x = torch.randn(2, 9, config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = block(x.clone())
        layer = MoELayer.wrap(block, config, router, top_k=k).eval()
        got = layer(x.clone())
    assert got.shape == want.shape
    assert (got - want).abs().max() < 1e-5
    assert layer.last is not None and layer.last.dropped == 0 and int(layer.last.counts.sum()) == 18 * k


@pytest.mark.parametrize("router,layout", [("deepseek", "mixtral"), ("switch", "deepseek_v3"),
                                           ("gshard", "glm4_moe")])
def test_a_router_refuses_a_layout_it_cannot_be_served_in(router: str, layout: str) -> None:
    config = _config(layout, 2)
    with pytest.raises(BuildError, match=f"the {router} router does not fit"):
        MoELayer.wrap(_block(config), config, router)


def test_layout_rule_refuses_dense_models() -> None:
    with pytest.raises(BuildError, match="not an MoE layout"):
        LayoutRule.of(tf.LlamaConfig())


# ---- the routers' training behaviour (tiny presets) ----

def test_switch_capacity_drops_overflow_and_its_losses() -> None:
    router = SwitchRouter.tiny().train()
    router.capacity_factor = 0.5
    with torch.no_grad():
        router.weight.zero_()
        router.weight[2] = 5.0  # every token prefers expert 2
    x = torch.rand(16, 16)
    r = router(x)
    capacity = 2  # ceil(0.5 * 16 / 4)
    assert (r.experts[:, 0] == 2).sum() == capacity and r.dropped == 16 - capacity
    assert (r.weights[r.experts < 0] == 0).all() and (r.weights[r.experts >= 0] == 1).all()  # top-1 as served: 1
    assert r.counts.tolist() == [0, 0, 16, 0]  # decisions before capacity
    assert float(r.aux.detach()) > 0.01 * 3.5  # collapsed: the aux loss approaches E = 4 (times the 0.01 weight)
    # the straight-through weight still carries the router's gradient
    (r.weights.sum() * 1.0).backward()
    assert router.weight.grad is not None


def test_balance_losses_and_stats() -> None:
    uniform = torch.full((8, 4), 0.25)
    even = torch.nn.functional.one_hot(torch.arange(8) % 4, 4)
    assert float(switch_aux_loss(uniform, even)) == pytest.approx(1.0)
    collapsed = torch.nn.functional.one_hot(torch.zeros(8, dtype=torch.long), 4)
    assert float(switch_aux_loss(torch.eye(4)[[0] * 8], collapsed)) == pytest.approx(4.0)
    assert float(router_z_loss(torch.zeros(3, 4))) == pytest.approx(float(torch.log(torch.tensor(4.0))) ** 2)
    assert load_stats([5, 5, 5, 5]) == {"cv": 0.0, "max_min": 1.0, "per_expert": [5, 5, 5, 5]}
    skew = load_stats([[1, 3], [2, 2]])
    assert skew["cv"] == pytest.approx(0.25) and skew["max_min"] == pytest.approx(2.0)
    assert load_stats([0, 4])["max_min"] == float("inf")
    with pytest.raises(ValueError, match="speed"):
        BiasBalancer(torch.zeros(2), -1.0)


def test_capacity_fills_first_choices_before_second_choices() -> None:
    idx = torch.tensor([[1, 0], [1, 0], [0, 1], [0, 1]])
    w = torch.full((4, 2), 0.5)
    kept, weights, dropped = capacity_limit(idx, w, 2, capacity=2)
    # expert 0: first choices of rows 2 and 3 take its two slots, so the second choices of rows 0 and 1 drop
    assert kept.tolist() == [[1, -1], [1, -1], [0, -1], [0, -1]] and dropped == 4
    assert weights[:, 1].tolist() == [0, 0, 0, 0]


def test_gshard_dispatches_the_second_expert_with_probability_2_g2() -> None:
    router = GShardRouter.tiny(hidden=16, experts=4).train()
    router.capacity_factor = 10.0  # no drops: measure dispatch alone
    router.generator = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 16, generator=torch.Generator().manual_seed(1))
    r = router(x)
    with torch.no_grad():
        probs = torch.softmax(torch.nn.functional.linear(x, router.weight), -1)
        top = probs.topk(2, -1).values
        expected = float(torch.clamp(2 * top[:, 1] / top.sum(-1), max=1).mean())
    assert float((r.experts[:, 1] >= 0).float().mean()) == pytest.approx(expected, abs=0.03)
    assert (r.experts[:, 0] >= 0).all()
    router.eval()
    assert (router(x).experts >= 0).all()  # at inference both experts always run


def _skewed_router(speed: float) -> tuple[DeepSeekRouter, torch.Tensor]:
    router = DeepSeekRouter.tiny(hidden=16, experts=8).train()
    router.balancer.speed = speed
    with torch.no_grad():
        router.weight.normal_(0, 0.1)
        router.weight[0] += 0.5  # expert 0 and 1 win for most tokens
        router.weight[1] += 0.4
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(2)) + 1.0
    return router, x


def test_auxiliary_loss_free_bias_balances_a_skewed_router_without_a_loss_term() -> None:
    skewed, x = _skewed_router(0.0)
    balanced, _ = _skewed_router(0.005)
    late = {id(skewed): torch.zeros(8, dtype=torch.long), id(balanced): torch.zeros(8, dtype=torch.long)}
    for step in range(400):
        for router in (skewed, balanced):
            r = router(x)
            assert float(r.aux) == 0.0  # no auxiliary loss: only the selection bias moves
            router.step_end()
            if step >= 300:  # the load of the last 100 steps (a sign update keeps oscillating by `speed`)
                late[id(router)] += r.counts
    before, after = load_stats(late[id(skewed)]), load_stats(late[id(balanced)])
    assert before["cv"] > 0.8 and after["cv"] < 0.1, (before, after)
    # the bias changes which experts are chosen, never the weight they get: weights are the plain scores
    r = balanced.eval()(x)
    scores = torch.sigmoid(torch.nn.functional.linear(x, balanced.weight)).gather(1, r.experts)
    assert torch.allclose(r.weights, scores / scores.sum(-1, keepdim=True))


# ---- chorus train moe ----

@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    smollm2 = prepared_model_dir("smollm2-135m-instruct")
    root = tmp_path_factory.mktemp("moe-train")
    words = "the cat sat on the mat and the dog sat on the log while the bird sang in the tree".split()
    data = root / "train.jsonl"
    data.write_text("\n".join(json.dumps({"text": " ".join(words[i % 5:] + words[: i % 5])}) for i in range(60)))
    return tiny_llama(root / "base", layers=2, vocab=49152, tokenizer_from=smollm2), data


@pytest.mark.parametrize("router,arch,k", [("switch", "MixtralForCausalLM", 1), ("gshard", "MixtralForCausalLM", 2),
                                           ("deepseek", "Glm4MoeForCausalLM", 2), ("dense", "LlamaForCausalLM", 0)])
def test_train_moe_lowers_the_loss_and_writes_a_servable_checkpoint(corpus: tuple[Path, Path], tmp_path: Path,
                                                                    router: str, arch: str, k: int) -> None:
    base, data = corpus
    out = tmp_path / router
    tc = MoeTrainConfig(router=router, steps=15, batch_size=4, seq_len=16, lr=3e-3, log_every=100,
                        noise=None if router == "dense" else 0.05)
    summary = train_moe(base, data, out, tc, log=lambda _: None)
    assert summary["loss_after"] < summary["loss_before"] - 0.5
    manifest = json.loads((out / "chorus-prepared.json").read_text())
    assert manifest["training"]["loss_after"] == summary["loss_after"] and (out / "tokenizer.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == arch
    if router == "dense":
        return
    assert model.config.num_experts_per_tok == k
    assert sum(summary["load"]["per_expert"]) > 0 and 0 <= summary["dropped_share"] < 1
    names = load_file(out / "model.safetensors")
    if router == "deepseek":
        assert summary["dropped_share"] == 0 and summary["aux_loss_mean"] == 0  # no capacity, no loss term
        bias = names["model.layers.0.mlp.gate.e_score_correction_bias"]
        assert float(bias.abs().sum()) > 0 and bias.tolist() == pytest.approx(summary["selection_bias"][0], abs=1e-4)
    else:
        assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in names  # the hub layout vLLM loads
        assert summary["aux_loss_mean"] > 0
    experts = [names[f"model.layers.0.{'mlp' if router == 'deepseek' else 'block_sparse_moe'}.experts.{e}."
                     f"{'up_proj' if router == 'deepseek' else 'w3'}.weight"] for e in range(2)]
    assert not torch.equal(experts[0], experts[1])  # the copies diverged
    load = ExpertLoad(model)  # what serving observes
    load.before([])
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7, 8]]))
    assert int(load.count(torch.arange(4)).sum()) == 2 * 4 * k


def test_train_moe_continues_an_moe_checkpoint_and_refuses_bad_settings(corpus: tuple[Path, Path],
                                                                       tmp_path: Path) -> None:
    base, data = corpus
    first = tmp_path / "first"
    train_moe(base, data, first, MoeTrainConfig(router="gshard", steps=2, seq_len=16, log_every=100),
              log=lambda _: None)
    again = train_moe(first, data, tmp_path / "again", MoeTrainConfig(router="switch", steps=2, seq_len=16,
                                                                       log_every=100), log=lambda _: None)
    assert again["router"] == "switch"
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "again").config.num_experts_per_tok == 1
    bad = [
        (first, MoeTrainConfig(router="deepseek"), "the deepseek router does not fit the mixtral layout"),
        (first, MoeTrainConfig(router="dense"), "already an MoE model"),
        (base, MoeTrainConfig(router="expert-choice"), "--router must be one of"),
        (base, MoeTrainConfig(router="switch", capacity_factor=0), "--capacity must be > 0"),
        # a setting the chosen router has no use for is refused, not ignored
        (
            base,
            MoeTrainConfig(router="switch", bias_speed=0.1),
            "--bias-speed applies to --router deepseek, not switch",
        ),
        (base, MoeTrainConfig(router="gshard", top_k=3), "--top-k applies to --router deepseek, not gshard"),
        (
            base,
            MoeTrainConfig(router="deepseek", capacity_factor=2.0),
            "--capacity applies to --router switch / gshard",
        ),
        (base, MoeTrainConfig(router="dense", experts=8), "--experts applies to upcycling, not to --router dense"),
        (first, MoeTrainConfig(router="gshard", experts=8), "--experts applies to upcycling a dense base"),
        (tmp_path / "missing", MoeTrainConfig(), "not a checkpoint directory"),
    ]
    if not torch.cuda.is_available():
        bad.append((base, MoeTrainConfig(router="switch", device="cuda"), "no CUDA device is available"))
    for src, tc, needle in bad:
        tc.steps, tc.seq_len = 1, 16
        with pytest.raises(BuildError, match=needle):
            train_moe(src, data, tmp_path / "bad", tc, log=lambda _: None)
        assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("layout", ["qwen2_moe", "deepseek_v3"])
def test_train_moe_reads_and_writes_the_other_layouts(corpus: tuple[Path, Path], tmp_path: Path, layout: str) -> None:
    """A Qwen2-MoE checkpoint (upcycled with a gated shared expert) and a real DeepSeek-V3 checkpoint (its own class,
    multi-head latent attention) train in place and are written back in their own layout."""
    from chorus.engines.families.checkpoint import copy_tokenizer
    from chorus.engines.families.moe import UpcycleConfig, upcycle

    base, data = corpus
    if layout == "qwen2_moe":
        src = upcycle(base, tmp_path / "src", UpcycleConfig(experts=4, top_k=2, shared_expert=True, noise=0.05),
                      log=lambda _: None)
        router, arch, moved = "gshard", "Qwen2MoeForCausalLM", "model.layers.0.mlp.shared_expert_gate.weight"
    else:
        torch.manual_seed(0)
        cfg = _config("deepseek_v3", 2, vocab_size=49152, num_hidden_layers=2)
        src = tmp_path / "src"
        AutoModelForCausalLM.from_config(cfg).save_pretrained(src)
        copy_tokenizer(base, src)
        router, arch, moved = "deepseek", "DeepseekV3ForCausalLM", "model.layers.0.mlp.gate.e_score_correction_bias"
    before = load_file(src / "model.safetensors")[moved].clone()
    out = tmp_path / "out"
    train_moe(src, data, out, MoeTrainConfig(router=router, steps=3, seq_len=16, lr=3e-3, log_every=100,
                                             bias_speed=0.01 if router == "deepseek" else None), log=lambda _: None)
    assert type(AutoModelForCausalLM.from_pretrained(out)).__name__ == arch
    assert not torch.equal(load_file(out / "model.safetensors")[moved], before)


def test_cli_train_moe(corpus: tuple[Path, Path], tmp_path: Path) -> None:
    base, data = corpus
    out = tmp_path / "cli"

    def run(target: Path, *extra: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "chorus", "train", "moe", "--base", str(base), "--data", str(data), "--out",
               str(target), "--router", "deepseek", "--experts", "4", "--steps", "2", "--seq-len", "16", *extra]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    res = run(out, "--top-k", "2")
    assert res.returncode == 0, res.stderr
    assert json.loads((out / "config.json").read_text())["model_type"] == "glm4_moe"
    res = run(tmp_path / "bad", "--top-k", "9")
    assert res.returncode == 2 and "--top-k must be between 1 and --experts=4" in res.stderr
    res = run(out, "--top-k", "2")
    assert res.returncode == 2 and "already exists" in res.stderr


def test_gpu_check_script_runs_on_cpu_with_tiny_shapes() -> None:
    """scripts/bench-gpu moe (what runs on a lent GPU machine) on CPU with tiny shapes: it cannot rot unseen."""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(["bash", str(root / "scripts" / "bench-gpu"), "moe", "--tiny", "--cpu", "--steps", "2",
                          "--batch-size", "2", "--seq-len", "32"], capture_output=True, text=True, timeout=600,
                         check=True, env={**os.environ, "PYTHON": sys.executable}).stdout
    diffs = [
        line for line in out.splitlines() if line.startswith(("| mixtral", "| qwen2_moe", "| deepseek_v3", "| glm4"))
    ]
    assert len(diffs) == 4 and all(float(line.split("|")[2]) < 1e-5 for line in diffs), out
    for arch in ("LlamaForCausalLM", "MixtralForCausalLM", "Glm4MoeForCausalLM"):
        assert f"| {arch} " in out
