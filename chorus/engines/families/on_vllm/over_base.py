"""What chorus's MoDr and ReasonFormer models share on vLLM: the frozen base as vLLM's own Llama layers (fused
q/k/v, vLLM's attention kernels and paged KV cache) read from the base's directory, one extra KV slot per
(layer, recurrence step) as an `Attention` of its own, a decoder layer run with a LoRA delta and a chosen slot,
and the sequences of a flat vLLM batch (for decisions made per sequence).

How chorus's per-row execution maps onto vLLM's: vLLM hands the model one flat batch of tokens from many
sequences (prompts being prefilled beside sequences decoding one token); a sequence's tokens are contiguous, and
the attention metadata's ``query_start_loc`` says where each starts. A decision chorus makes per row over the
tokens of the forward (a MoDr routing, a ReasonFormer skill choice) is made here per such sequence. Served eager
(``--enforce-eager``), on one device (tensor parallel 1), without vLLM's prefix cache: a routing made over the
prompt needs the whole prompt in the forward."""

from __future__ import annotations

import glob
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.models.llama import LlamaForCausalLM


def check_serving(vllm_config: VllmConfig, what: str) -> None:
    """The settings this plugin needs, refused clearly rather than served wrong."""
    if get_tensor_model_parallel_world_size() != 1:
        raise ValueError(f"chorus's {what} plugin runs on one device (tensor parallel 1)")
    if not vllm_config.model_config.enforce_eager:
        raise ValueError(f"chorus's {what} plugin runs eager (its routing is data-dependent): start vLLM with "
                         "--enforce-eager")
    if vllm_config.cache_config.enable_prefix_caching:
        raise ValueError(f"chorus's {what} plugin routes over the whole prompt: start vLLM with "
                         "--no-enable-prefix-caching")


def sequences(n_tokens: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """For each token of the flat batch, the index of its sequence (N,), and the number of sequences + 1 (the
    last index holds padding tokens, if any). Without attention metadata (vLLM's dummy runs): one sequence."""
    meta: Any = get_forward_context().attn_metadata
    if isinstance(meta, list):  # micro-batches: the first one's (never used with the plugin's settings)
        meta = meta[0] if meta else None
    if isinstance(meta, dict):
        meta = next(iter(meta.values()), None)
    starts = getattr(meta, "query_start_loc", None)
    if starts is None:
        return torch.zeros(n_tokens, dtype=torch.long, device=device), 1
    starts = starts.to(device=device, dtype=torch.long)
    counts = starts[1:] - starts[:-1]
    n_seq = counts.shape[0]
    seg = torch.repeat_interleave(torch.arange(n_seq, device=device), counts)
    pad = n_tokens - seg.shape[0]
    if pad > 0:
        seg = torch.cat([seg, torch.full((pad,), n_seq, dtype=torch.long, device=device)])
    return seg[:n_tokens], n_seq + 1


def sequence_mean(x: torch.Tensor, seg: torch.Tensor, n: int) -> torch.Tensor:
    """(N, d) -> (n, d): the mean of each sequence's tokens."""
    sums = torch.zeros(n, x.shape[1], dtype=x.dtype, device=x.device).index_add_(0, seg, x)
    counts = torch.bincount(seg, minlength=n).clamp(min=1).to(x.dtype)
    return sums / counts[:, None]


class LoRADelta:
    """The LoRA delta of one projection with a bank of entries: entry ``pick[n]`` for token n, scaled by
    ``scale[n]``. A: (E, r, in), B: (E, out, r). Every entry runs on every token, masked (E is small, r tiny):
    no data-dependent shapes."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.a, self.b = a, b

    def __call__(self, x: torch.Tensor, pick: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape[0], self.b.shape[1], dtype=x.dtype, device=x.device)
        for e in range(self.a.shape[0]):
            w = (pick == e).to(x.dtype) * scale  # (N,)
            out.addmm_(x.mm(self.a[e].t()) * w[:, None], self.b[e].t())
        return out


def stack_qkv(parts: list[tuple[torch.Tensor, torch.Tensor] | None], sizes: tuple[int, int, int], rank: int,
              entries: int, hidden: int) -> LoRADelta:
    """q, k and v's LoRAs (None: no LoRA on that projection) as one delta on vLLM's fused q/k/v output."""
    dtype = next((p[0].dtype for p in parts if p is not None), torch.float32)
    a = torch.zeros(entries, 3 * rank, hidden, dtype=dtype)
    b = torch.zeros(entries, sum(sizes), 3 * rank, dtype=dtype)
    row = 0
    for j, (part, size) in enumerate(zip(parts, sizes)):
        if part is not None:
            a[:, j * rank:(j + 1) * rank] = part[0]
            b[:, row:row + size, j * rank:(j + 1) * rank] = part[1]
        row += size
    return LoRADelta(a, b)


class Lora:
    """The LoRAs of one attention layer for one forward: q/k/v fused, o, and which entry each token uses."""

    def __init__(self, qkv: LoRADelta | None, o: LoRADelta | None, pick: torch.Tensor, scale: torch.Tensor) -> None:
        self.qkv, self.o, self.pick, self.scale = qkv, o, pick, scale


def layer_forward(layer: Any, positions: torch.Tensor, x: torch.Tensor, attn: Attention | None = None,
                  loras: list[Lora] = ()) -> torch.Tensor:  # type: ignore[assignment]
    """vLLM's Llama decoder layer on the full hidden state x (N, h), with LoRA deltas added to q/k/v and o, and
    its attention read from / written to ``attn`` (a KV slot; default: the layer's own)."""
    sa = layer.self_attn
    h = layer.input_layernorm(x)
    qkv, _ = sa.qkv_proj(h)
    for lo in loras:
        if lo.qkv is not None:
            qkv = qkv + lo.qkv(h, lo.pick, lo.scale)
    q, k, v = qkv.split([sa.q_size, sa.kv_size, sa.kv_size], dim=-1)
    q, k = sa.rotary_emb(positions, q, k)
    o = (attn or sa.attn)(q, k, v)
    out, _ = sa.o_proj(o)
    for lo in loras:
        if lo.o is not None:
            out = out + lo.o(o, lo.pick, lo.scale)
    x = x + out
    return x + layer.mlp(layer.post_attention_layernorm(x))


class OverBaseForCausalLM(LlamaForCausalLM):
    """vLLM's Llama over the base's weights, plus the family's own parts (``self.own``, loaded from the
    checkpoint's safetensors) and KV slots (``self.slots``: index -> `Attention`)."""

    family = ""  #: the config key of the family's settings ("modr")
    what = ""  #: its name in messages

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        check_serving(vllm_config, self.what)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        config = vllm_config.model_config.hf_config
        self.settings: dict[str, Any] = dict(getattr(config, self.family))
        self.base_dir = Path(config.base_dir)
        self.cache_config = vllm_config.cache_config
        self.slots = nn.ModuleDict()
        self.own_tensors: dict[str, torch.Tensor] = {}

    def new_slot(self, like: Any) -> Attention:
        """A KV slot shaped as the attention ``like`` (a vLLM LlamaAttention), with an index of its own."""
        index = self.config.num_hidden_layers + len(self.slots)
        attn = Attention(like.num_heads, like.head_dim, like.scaling, num_kv_heads=like.num_kv_heads,
                         cache_config=self.cache_config, prefix=f"slots.{index}")
        self.slots[str(index)] = attn
        return attn

    def span(self, key: str) -> range:
        a, b = self.settings[key]
        return range(int(a), int(b))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's safetensors hold the family's own tensors (kept in ``own_tensors`` for
        `load_own`); the base's are read from its directory into vLLM's Llama."""
        from safetensors.torch import safe_open

        self.own_tensors = {name: t for name, t in weights}

        def base_weights() -> Iterable[tuple[str, torch.Tensor]]:
            files = sorted(glob.glob(str(self.base_dir / "*.safetensors")))
            if not files:
                raise ValueError(f"{self.what}: no safetensors in the base directory {self.base_dir}")
            for f in files:
                with safe_open(f, framework="pt") as st:
                    for name in st.keys():
                        yield name, st.get_tensor(name)

        loaded = set(super().load_weights(base_weights()))
        self.load_own(self.own_tensors)
        return loaded | {name for name, _ in self.named_parameters()}

    def load_own(self, tensors: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def run(self, span: range, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The base's layers of ``span`` as they are (their own KV slots)."""
        layers: Any = self.model.layers
        for i in span:
            x = layer_forward(layers[i], positions, x)
        return x

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """The base's final norm: what vLLM's ``compute_logits`` takes (then the head)."""
        return self.model.norm(x)
