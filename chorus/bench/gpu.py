"""`chorus bench gpu` (``make bench-gpu``): the engine and the token ensembles on a GPU, no model files.

Built for a bare GPU machine that has only PyTorch and transformers (``scripts/bench-gpu`` brings the
few pure-Python packages chorus's ensembles import): models of real shapes are built from configs with
random weights in bf16 (SmolLM2-135M's and Qwen2.5-1.5B's), prompts are random token ids, and one run
prints, within a few minutes:

1. decode throughput at 1, 8 and 64 concurrent streams: chorus's batching engine (`BatchRunner`, one
   session per stream, greedy) vs ``model.generate()`` on the same batch vs transformers' own
   continuous batching (``generate_batch``, where this transformers has it);
2. logit averaging of two SmolLM2-shaped members in modes ``full``, ``selective`` and ``speculative``
   vs the lead alone: the same weights twice (drafts always accepted: the best case) and two different
   random initialisations (they disagree: the worst case). Random weights mean nothing about quality;
   only speed and acceptance are measured.

``--tiny`` shrinks every shape (and the stream counts) so CI runs the same code on CPU in seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence
from typing import Any

import torch

from chorus.clients.local import markdown_table
from chorus.engines.core.base import GenerationRequest, SamplingParams, Session
from chorus.engines.core.generation import SessionEngine
from chorus.engines.core.request_scope import RequestScope
from chorus.engines.transformers.batching import BatchRunner

SHAPES: dict[str, dict[str, Any]] = {
    "SmolLM2-135M": {"family": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152},
    "Qwen2.5-1.5B": {"family": "qwen2", "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936},
}
TINY: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "vocab_size": 512}


def build(shape: dict[str, Any], device: str, dtype: torch.dtype, seed: int, tiny: bool) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    kw = {k: v for k, v in shape.items() if k != "family"}
    if tiny:
        kw.update(TINY)
    cfg = (LlamaConfig if shape["family"] == "llama" else Qwen2Config)(max_position_embeddings=4096, **kw)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


class IdTokenizer:
    """Token ids as text (the decode loop needs a tokenizer; random prompts have no words)."""

    def __init__(self, vocab: int) -> None:
        self.vocab_size = vocab
        self.eos_token_ids: frozenset[int] = frozenset()  # never stop early: every run decodes its full length
        self.fingerprint = f"ids-{vocab}"
        self.chat_stop: tuple[str, ...] = ()

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(i) for i in ids)


class RandomModelEngine(SessionEngine):
    """A session engine over a `BatchRunner` of a random model (what LogitAverage needs of a member)."""

    def __init__(self, name: str, runner: BatchRunner, vocab: int) -> None:
        self.name, self.runner, self.tokenizer = name, runner, IdTokenizer(vocab)  # type: ignore[assignment]
        self.max_model_len, self.sampling_defaults = runner.max_model_len, {}

    def open_session(self, scope: RequestScope | None = None) -> Session:
        return self.runner.open_many(1, scope=scope)[0]

    @property
    def active_sessions(self) -> int:
        return len(self.runner.sessions)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


async def chorus_rate(runner: Any, prompts: list[list[int]], tokens: int, device: str) -> float:
    async def one(p: list[int]) -> None:
        (s,) = runner.open_many(1)
        try:
            logits = await runner.submit_prefill([s], p)
            for _ in range(tokens - 1):
                logits = await s.step(int(logits.argmax()))
        finally:
            s.close()

    sync(device)
    t0 = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    sync(device)
    return len(prompts) * tokens / (time.perf_counter() - t0)


def generate_rate(model: Any, prompts: list[list[int]], tokens: int, device: str) -> float:
    ids = torch.tensor(prompts, device=device)
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                       do_sample=False, pad_token_id=0)
    sync(device)
    return len(prompts) * tokens / (time.perf_counter() - t0)


def continuous_rate(model: Any, prompts: list[list[int]], tokens: int, device: str) -> float | None:
    if not hasattr(model, "generate_batch"):
        return None
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, eos_token_id=-1,
                           pad_token_id=0)
    sync(device)
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            model.generate_batch(inputs=prompts, generation_config=cfg, progress_bar=False)
    except Exception as exc:  # its API moves between releases: report, do not fail the whole run
        print(f"  generate_batch failed: {type(exc).__name__}: {exc}")
        return None
    sync(device)
    return len(prompts) * tokens / (time.perf_counter() - t0)


async def bench_engine(name: str, model: Any, args: argparse.Namespace, device: str) -> list[list[str]]:
    vocab = model.config.vocab_size
    rows = []
    for streams in args.streams:
        gen = torch.Generator().manual_seed(streams)
        prompts = torch.randint(3, vocab, (streams, args.prompt), generator=gen).tolist()
        runner = BatchRunner(model, max_model_len=args.prompt + args.tokens + 8, max_batch_size=max(streams, 1),
                             prefill_chunk=max(512, args.prompt * streams))
        try:
            await chorus_rate(runner, prompts[:1], 4, device)  # warm-up
            ours = await chorus_rate(runner, prompts, args.tokens, device)
        finally:
            await runner.stop()
        base = generate_rate(model, prompts, args.tokens, device)
        # transformers' continuous batching busy-waits on CPU (minutes of system time): GPU only
        cb = continuous_rate(model, prompts, args.tokens, device) if device == "cuda" else None
        rows.append([name, str(streams), f"{base:.0f}", f"{ours:.0f}", f"{ours / base:.2f}x",
                     "n/a" if cb is None else f"{cb:.0f}", "-" if cb is None else f"{ours / cb:.2f}x"])
    return rows


async def bench_modes(models: dict[str, Any], args: argparse.Namespace, device: str) -> list[list[str]]:
    from chorus.ensembles.logit_average.mixing import Mixing
    from chorus.ensembles.logit_average.shared_vocab import LogitAverage  # imports pydantic: bench-gpu brings it

    vocab = models["lead"].config.vocab_size
    runners = {k: BatchRunner(m, max_model_len=args.prompt + args.tokens + 32) for k, m in models.items()}
    engines = {k: RandomModelEngine(k, r, vocab) for k, r in runners.items()}
    prompt = torch.randint(3, vocab, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    req = GenerationRequest(prompt, SamplingParams(temperature=0, max_tokens=args.tokens))
    rows = []
    try:
        await engines["lead"].generate(GenerationRequest(prompt, SamplingParams(temperature=0, max_tokens=4)))
        for pair, other in (("same weights twice (best case)", "lead"), ("two random inits (worst case)", "other")):
            members: list[Any] = [engines["lead"], engines[other]]  # engines by shape (ids, not words)
            systems = {"lead alone": engines["lead"], "full": LogitAverage(members),
                       f"selective, gate {args.gate:g}": LogitAverage(members, Mixing(mode="selective", gate=args.gate)),
                       f"speculative, k={args.k}": LogitAverage(members, Mixing(mode="speculative", k=args.k))}
            results: dict[str, tuple[float, list[int]]] = {}  # label -> tokens/s, output ids
            for label, system in systems.items():
                sync(device)
                t0 = time.perf_counter()
                out = await system.generate(req)
                sync(device)
                results[label] = (out.completion_tokens / (time.perf_counter() - t0), out.choices[0].token_ids)
            full_rate, full_ids = results["full"]
            lead_rate = results["lead alone"][0]
            for label, (rate, ids) in results.items():
                tally = getattr(systems[label], "tally", None)
                share = "-" if tally is None else f"{100 * tally.consulted / max(tally.positions, 1):.0f}%"
                accept = "-" if tally is None or not tally.proposed else f"{100 * tally.accepted / tally.proposed:.0f}%"
                same = "-" if label in ("full", "lead alone") else ("yes" if ids == full_ids else "no")
                rows.append([pair, label, f"{rate:.1f}", f"{rate / full_rate:.2f}x", f"{rate / lead_rate:.2f}x",
                             share, accept, same])
    finally:
        for r in runners.values():
            await r.stop()
    return rows


async def run(args: argparse.Namespace) -> str:
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.tiny:
        args.streams = [s for s in args.streams if s <= 8]
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    out = [f"chorus bench gpu: {where}, {dtype}, random weights, prompt {args.prompt} tokens, {args.tokens} new "
           f"tokens, greedy{' (tiny shapes)' if args.tiny else ''}"]
    rows: list[list[str]] = []
    for name in args.shapes:
        t0 = time.perf_counter()
        model = build(SHAPES[name], device, dtype, 0, args.tiny)
        print(f"{name}: built in {time.perf_counter() - t0:.1f} s", flush=True)
        rows += await bench_engine(name, model, args, device)
        del model
    out.append(markdown_table(["model", "streams", "generate() tok/s", "chorus tok/s", "vs generate()",
                               "continuous batching tok/s", "vs continuous"], rows))
    shape = SHAPES[args.shapes[0]]
    models = {"lead": build(shape, device, dtype, 0, args.tiny), "other": build(shape, device, dtype, 1, args.tiny)}
    out.append(f"\nlogit averaging, two {args.shapes[0]}-shaped members, 1 stream:")
    out.append(markdown_table(["members", "system", "tok/s", "vs full", "vs lead alone", "combined at",
                               "drafts accepted", "= full's output"], await bench_modes(models, args, device)))
    return "\n".join(out)


def main(args: argparse.Namespace) -> int:
    print(asyncio.run(run(args)))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per stream")
    p.add_argument("--tokens", type=int, default=128, help="new tokens per stream")
    p.add_argument("--gate", type=float, default=0.5, help="selective: top-1 gate")
    p.add_argument("--k", type=int, default=4, help="speculative: drafts per round")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, at most 8 streams: the CPU check CI runs")
    p.add_argument("--cpu", action="store_true", help="run on CPU even where a GPU is present")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
