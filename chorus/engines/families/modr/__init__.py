"""MoDr: a recurrent-depth transformer whose recurrent core has N routed LoRA branches (docs/methods.md §8).

The package: ``config`` (MoDrConfig), ``model`` (the module, its branches and per-step KV slots),
``checkpoint`` (save / load / retrofit), ``serving`` (request options and the batching observer),
``train`` (``chorus train modr``).

Structure (Huginn): prelude P, recurrent core R, coda C over a frozen Llama-architecture base::

    e   = P(embed(x))                                   # (B, L, h)
    s_0 = e                                             # see "choices" below
    h_t = adapter([s_{t-1}; e])                         # Linear 2h -> h
    s_t = R_branch(h_t)                                 # core layers, q/k/v/o + g * LoRA_branch
    out = head(norm(C(s_T)))

Router (section 8): ``u = W_router h_t`` (N x h); ``r = sigmoid(mean over the sequence's tokens of u)``;
branch ``= argmax(r + b)``; gate ``g = r[branch]`` (bias excluded). Prefill routes once per sequence
(per prefill chunk for prompts longer than the engine's chunk); in decoding n = 1, so every new token
is routed again (relay) while past tokens' K/V stay as computed.

Choices the papers leave open, made here:

- The router is re-evaluated at every recurrence step (its input h_t changes with the state).
- g scales the chosen branch's LoRA delta in every core projection: ``W x + g (alpha/r) B A x``.
  So fresh branches (B = 0) leave the core exactly the base's, whatever the router says.
- Retrofitting starts from ``s_0 = e`` and ``adapter = [I/2 | I/2]``: the first recurrence sees
  exactly e, so with contiguous layer ranges covering the base, one recurrence with fresh branches
  *is* the base model (tested); later steps see the mean of state and injection. (Huginn samples
  s_0 from a truncated normal; ``state_init: random`` does that.)
- KV cache: one slot per (core layer, recurrence step). A token that stops early (adaptive exit or a
  lower ``recurrence``) gets its last step's K/V copied into the later steps' slots, so later tokens
  read the latest state (Huginn's "latest" lookup). ``kv_share: N`` keeps only N step slots
  (step t uses slot t mod N, overwriting).
- Adaptive exit compares successive next-token distributions (coda + head run on the state after
  each step, without writing the coda's cache) and stops a token when ``KL(p_{t-1} || p_t)`` falls
  under the threshold; it applies to decoded tokens (a prompt runs the requested recurrence).

Checkpoint (`save_modr` / `load_modr`): ``config.json`` (``model_type: chorus_modr``, the base
reference, layer ranges, branch settings), ``modr.safetensors`` (adapter, router, bias, LoRA A/B)
and the tokenizer files; the base weights stay in the base directory.
"""

from chorus.engines.families.modr.checkpoint import build_retrofit, is_modr_dir, load_base_model, load_modr, save_modr
from chorus.engines.families.modr.config import TARGETS, WEIGHTS, MoDrConfig
from chorus.engines.families.modr.model import MoDrModel, MoDrOutput, RowControl, RowReport
from chorus.engines.families.modr.serving import RoutingObserver, check_options
from chorus.engines.runtime.kv_cache import grow_steps, step_slots

__all__ = ["TARGETS", "WEIGHTS", "MoDrConfig", "MoDrModel", "MoDrOutput", "RoutingObserver", "RowControl", "RowReport",
           "build_retrofit", "check_options", "grow_steps", "is_modr_dir", "load_base_model", "load_modr", "save_modr",
           "step_slots"]
