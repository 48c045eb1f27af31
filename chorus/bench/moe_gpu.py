"""`chorus bench moe-gpu` (``scripts/bench-gpu moe``): ``chorus train moe --device cuda`` on a bare GPU machine.

No model files travel to a lent GPU machine, so the check builds what it needs: a SmolLM2-135M-shaped
Llama with random weights, a word-level tokenizer (the `tokenizers` library transformers ships with)
and a synthetic text corpus. Then, on the GPU:

1. per layout (Mixtral, Qwen2-MoE, DeepSeek-V3, GLM-4-MoE) at that shape: the `MoELayer` in
   evaluation mode equals transformers' own MoE block on the same weights (max difference);
2. the dense fine-tune and one run per router (Switch, GShard, DeepSeek): held-out loss before and
   after, load CV, dropped share, training tokens/s; each result loads back with transformers.

Random weights say nothing about quality: this checks that the CUDA path runs, matches, and how fast
it trains. ``--tiny --cpu`` runs the same code on CPU in seconds (tests/unit/test_moe_training.py).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from chorus.clients.local import markdown_table

WORDS = ("the a one two three four five six seven eight nine ten apples pears cost each dollars sold bought gave "
         "half twice more less than total how many did she he they have left after week day store friends").split()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CI runs this on CPU)")
    p.add_argument("--cpu", action="store_true", help="run on CPU instead of CUDA")


def build_base(root: Path, shape: dict[str, Any]) -> Path:
    """A random Llama of the given shape plus a word-level tokenizer over WORDS, saved as a checkpoint."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = LlamaConfig(max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                      pad_token_id=2, **shape)
    base = root / "base"
    LlamaForCausalLM(cfg).save_pretrained(base)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            pad_token="</s>").save_pretrained(base)
    return base


def corpus(path: Path, rows: int) -> Path:
    rng = random.Random(0)
    lines = []
    for _ in range(rows):  # a repetitive pattern a model can learn quickly, with some variety
        n = rng.randint(3, 9)
        lines.append({"text": " ".join(WORDS[(i * 3 + n) % len(WORDS)] for i in range(40 + n))})
    path.write_text("\n".join(json.dumps(r) for r in lines))
    return path


def layout_checks(shape: dict[str, Any], device: str) -> list[list[Any]]:
    import torch
    import transformers as tf
    from transformers import AutoModelForCausalLM

    from chorus.engines.families.moe_layer import MoELayer

    common = {**shape, "num_hidden_layers": 1, "vocab_size": 128, "max_position_embeddings": 256}
    inter = shape["intermediate_size"]
    moe = dict(moe_intermediate_size=inter // 4, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
               first_k_dense_replace=0, n_group=4, topk_group=2)
    configs = {
        "mixtral (gshard)": (tf.MixtralConfig(**common, num_local_experts=8, num_experts_per_tok=2), "gshard", 2),
        "qwen2_moe (switch)": (tf.Qwen2MoeConfig(**common, moe_intermediate_size=inter, num_experts=8,
                                                 shared_expert_intermediate_size=inter, num_experts_per_tok=1,
                                                 norm_topk_prob=False), "switch", 1),
        "deepseek_v3 (deepseek)": (tf.DeepseekV3Config(**{**common, **moe}, q_lora_rank=None, kv_lora_rank=32,
                                                        qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32),
                                   "deepseek", 4),
        "glm4_moe (deepseek)": (tf.Glm4MoeConfig(**{**common, **moe}), "deepseek", 4),
    }
    rows = []
    for name, (config, router, k) in configs.items():
        torch.manual_seed(0)
        with torch.device(device):
            block = AutoModelForCausalLM.from_config(config).model.layers[0].mlp.eval()
            with torch.no_grad():
                for p in block.parameters():
                    p.normal_(0, 0.05)
                x = torch.randn(4, 64, shape["hidden_size"])
                want = block(x.clone())
                got = MoELayer.wrap(block, config, router, top_k=k).eval()(x.clone())
        rows.append([name, f"{float((got - want).abs().max()):.2e}", f"{float(want.abs().max()):.2f}"])
    return rows


def main(args: argparse.Namespace) -> int:
    import torch

    from chorus.training.moe import MoeTrainConfig, train_moe

    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu, or on the GPU machine")
        return 2
    from chorus.bench.gpu import SHAPES, TINY  # the engine benchmark's shapes (imports torch: here, not at --help)

    shape = TINY if args.tiny else {k: v for k, v in SHAPES["SmolLM2-135M"].items() if k != "family"}
    print(f"device {device}" + (f" ({torch.cuda.get_device_name(0)})" if device == "cuda" else "")
          + f", torch {torch.__version__}")
    rows = layout_checks(shape, device)
    print("\n### MoELayer (evaluation mode) vs transformers' MoE block, same weights\n")
    print(markdown_table(["layout (router)", "max abs difference", "max abs output"], rows))
    runs = []
    with tempfile.TemporaryDirectory(prefix="chorus-moe-gpu-") as tmp:
        root = Path(tmp)
        base = build_base(root, shape)
        data = corpus(root / "train.jsonl", 400)
        for router in ("dense", "switch", "gshard", "deepseek"):
            tc = MoeTrainConfig(router=router, experts=None if router == "dense" else args.experts, steps=args.steps,
                                batch_size=args.batch_size, seq_len=args.seq_len, lr=3e-4, device=device,
                                bias_speed=0.01 if router == "deepseek" else None,
                                log_every=args.steps + 1, eval_sequences=8)
            t0 = time.perf_counter()
            s = train_moe(base, data, root / router, tc, log=lambda _: None)
            wall = time.perf_counter() - t0
            from transformers import AutoModelForCausalLM

            loaded = type(AutoModelForCausalLM.from_pretrained(root / router)).__name__
            load = s.get("load") or {}
            runs.append([router, loaded, f"{s['loss_before']:.3f}", f"{s['loss_after']:.3f}",
                         f"{load.get('cv', 0):.3f}" if load else "-",
                         f"{s['dropped_share']:.1%}" if load else "-", f"{s['train_tokens_per_s']:.0f}",
                         f"{wall:.0f}"])
    print(f"\n### chorus train moe on {device}: {args.steps} steps x {args.batch_size} x {args.seq_len} tokens, "
          f"{args.experts} experts\n")
    print(markdown_table(["router", "saved as", "held-out loss before", "after", "load CV", "dropped",
                          "train tok/s", "wall s (incl. upcycle, save)"], runs))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
