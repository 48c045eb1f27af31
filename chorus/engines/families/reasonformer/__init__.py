"""ReasonFormer: skill-routed reasoning steps with a stop gate, retrofitted onto a frozen decoder
(docs/methods.md §12).

The package: ``config`` (ReasonFormerConfig), ``model`` (skill LoRAs, router, gate, per-step KV slots),
``checkpoint`` (save / load / retrofit), ``serving`` (request options and the batching observer),
``train`` (``chorus train reasonformer``).

Structure over a Llama-architecture base: representation = its first layers, the reasoning block = a
span of its middle layers, coda = the rest and the LM head::

    H~^0 = Rep(embed(x))
    step i = 1..T:  S^i  = softmax(FFN(pool(T_i(H~^{i-1}))))        # router: one small transformer layer
                    H^i  = sum_{j in top-k(S^i)} S^i_j R_j^i(H~^{i-1})  # weights renormalised over the top k
                    c^i  = prod_{m=2..i} g^m,  g^m = sigmoid(G_m(pool(H~^{m-1})))   (c^1 = 1)
                    H~^i = H~^{i-1} + c^i (H^i - H~^{i-1})
    out = head(norm(Coda(H~^T)))

``R_j^i`` is the reasoning block with skill j's LoRA at step i: ``shared`` modules share one LoRA per skill
across steps plus a step adapter (a LoRA of ``adapter_rank``) per (skill, step); ``private`` modules have
one LoRA per (skill, step) and no adapter.

Choices made here:

- The stop gate reads the state *before* step i (the paper gates the step's output): so a stopped step
  costs nothing. In training every step runs and the gates soft-stop (scale) later steps; at inference
  a row whose gate is below ``stop_threshold`` ends its cascade there (``max_steps`` caps it).
- Step 1 is never gated (the block must run once: it replaces the base's middle layers). With one step
  and fresh skills (LoRA B = 0) the model *is* the base (tested). Fresh gates start closed (bias -2,
  gate 0.12), so a fresh retrofit served at the default threshold 0.5 also stops after step 1.
- Routing and the stop decision are per instance, as in the paper: made on the prompt at prefill (its
  first prefill chunk for prompts longer than the engine's chunk) and kept for that sequence's decoded
  tokens. Scoring a continuation whole (``/v1/choices`` on this family) routes on prompt + continuation.
- KV cache: one slot per (layer, step, chosen-skill rank); a sequence keeps its skills, so rank q of
  step i always holds the same skill's K/V. Rows that stopped at different depths batch together
  (their later slots hold filler that their outputs never use).

Checkpoint: ``config.json`` (``model_type: chorus_reasonformer``, the base reference, the settings),
``reasonformer.safetensors`` (LoRA banks, routers, gates) and the tokenizer files.
"""

from chorus.engines.families.reasonformer.checkpoint import (
    build_retrofit,
    is_reasonformer_dir,
    load_base_model,
    load_reasonformer,
    save_reasonformer,
)
from chorus.engines.families.reasonformer.config import ReasonFormerConfig
from chorus.engines.families.reasonformer.model import Decision, ReasonFormerModel, RowControl
from chorus.engines.families.reasonformer.serving import OPTIONS, ReasonObserver, check_options

__all__ = ["OPTIONS", "Decision", "ReasonFormerConfig", "ReasonFormerModel", "ReasonObserver", "RowControl",
           "build_retrofit", "check_options", "is_reasonformer_dir", "load_base_model", "load_reasonformer",
           "save_reasonformer"]
