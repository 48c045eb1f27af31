"""Training a DUMA scorer (engines/families/duma.py): ``chorus train duma``.

Data: multiple-choice JSONL rows with ``choices`` (at least two strings), ``label`` (the right one's
index) and the text the options answer: ``context`` (a passage, or a sentence to complete) and/or
``question`` / ``goal``. The prompt is the text ``chorus eval`` sends to ``/v1/choices`` for the same row
(``Question: ...\\nAnswer: ``; a ``context`` alone as it stands), so the scorer trains on what it serves.
Every row is checked before training starts; a bad one is an error naming its line.

The loss is the cross-entropy of the softmax over each item's options; the encoder is fine-tuned with
the head (AdamW, the head at a larger learning rate, linear warm-up then decay). The model is evaluated
on the dev set a few times per epoch and the checkpoint written is the best of those (dev accuracy).
"""

from __future__ import annotations

import copy
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from chorus.engines.families.checkpoint import atomic_output, check_new_dir
from chorus.engines.families.duma import DumaConfig, DumaScorer, new_duma, save_duma, score_items
from chorus.errors import BuildError


@dataclass
class McItem:
    prompt: str
    choices: list[str]
    label: int


@dataclass
class TrainConfig:
    epochs: int = 2
    batch_size: int = 8  #: items per step (each item is all its options)
    lr: float = 5e-5  #: the encoder's
    head_lr: float = 1e-3
    weight_decay: float = 0.01
    warmup: float = 0.1  #: share of the steps with a linearly rising learning rate
    evals_per_epoch: int = 2
    dev_fraction: float = 0.1  #: held out of the training data when no dev file is given
    seed: int = 0
    device: str = "cpu"
    log_every: int = 50

    def check(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or self.evals_per_epoch < 1:
            raise BuildError("need epochs >= 1, batch size >= 1 and evals per epoch >= 1")
        if self.lr <= 0 or self.head_lr <= 0:
            raise BuildError("learning rates must be positive")
        if not 0 < self.dev_fraction < 1:
            raise BuildError(f"dev fraction must be in (0, 1) (got {self.dev_fraction})")


def mc_prompt(row: dict[str, Any]) -> str:
    """The prompt of a multiple-choice row, as ``chorus eval`` writes it for ``/v1/choices``."""
    question = row.get("question", row.get("goal"))
    if "context" in row:
        return f"{row['context']}\nQuestion: {question}\nAnswer: " if question else f"{row['context']} "
    return f"Question: {question}\nAnswer: "


def read_items(path: Path | str) -> list[McItem]:
    """Multiple-choice rows, every one checked (BuildError naming the line of the first bad one)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise BuildError(f"data file {path} does not exist")
    items = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise BuildError(f"{where}: not JSON ({exc})") from None
        if not isinstance(row, dict):
            raise BuildError(f"{where}: a row must be an object")
        choices = row.get("choices")
        if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
            raise BuildError(f"{where}: 'choices' must be a list of at least two non-empty strings")
        label = row.get("label")
        if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < len(choices):
            raise BuildError(f"{where}: 'label' must be an integer index into the {len(choices)} choices "
                             f"(got {label!r})")
        text = row.get("question", row.get("goal", row.get("context")))
        if not isinstance(text, str) or not text.strip():
            raise BuildError(f"{where}: needs the text the choices answer: 'question', 'goal' or 'context'")
        items.append(McItem(mc_prompt(row), list(choices), label))
    if not items:
        raise BuildError(f"{path} holds no rows")
    return items


def batches(items: list[McItem], size: int, rng: random.Random) -> list[list[McItem]]:
    """Batches of items of similar length (less padding), in random order."""
    order = sorted(range(len(items)), key=lambda i: (len(items[i].prompt) + max(map(len, items[i].choices)),
                                                     rng.random()))
    out = [[items[i] for i in order[k:k + size]] for k in range(0, len(order), size)]
    rng.shuffle(out)
    return out


def loss_of(logits: list[torch.Tensor], labels: list[int]) -> torch.Tensor:
    """Cross-entropy over each item's options (items may have different numbers of options)."""
    width = max(len(x) for x in logits)
    padded = torch.full((len(logits), width), float("-inf"), device=logits[0].device)
    for i, x in enumerate(logits):
        padded[i, : len(x)] = x
    return torch.nn.functional.cross_entropy(padded, torch.tensor(labels, device=padded.device))


@torch.inference_mode()
def accuracy(model: DumaScorer, tokenizer: Any, items: list[McItem], device: str = "cpu", batch: int = 32) -> float:
    was = model.training
    model.eval()
    right = 0
    for k in range(0, len(items), batch):
        chunk = items[k:k + batch]
        logits = score_items(model, tokenizer, [(it.prompt, it.choices) for it in chunk], device)
        right += sum(int(x.argmax()) == it.label for x, it in zip(logits, chunk))
    model.train(was)
    return right / len(items)


def train_duma(data: Path | str, out: Path | str, cfg: DumaConfig, tc: TrainConfig, *, dev: Path | str | None = None,
               encoder: str = "minilm", force: bool = False, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train, select on dev, write the best checkpoint atomically; returns what happened (also in config.json)."""
    out = check_new_dir(out, force)
    cfg.check()
    tc.check()
    items = read_items(data)
    rng = random.Random(tc.seed)
    if dev is not None:
        dev_items = read_items(dev)
    else:
        shuffled = items[:]
        rng.shuffle(shuffled)
        cut = max(1, int(len(shuffled) * tc.dev_fraction))
        dev_items, items = shuffled[:cut], shuffled[cut:]
        if not items:
            raise BuildError(f"{data}: too few rows to hold {tc.dev_fraction:.0%} out as a dev set")
    model, tokenizer = new_duma(encoder, cfg, tc.seed)
    model.to(tc.device).train()
    head = [p for n, p in model.named_parameters() if not n.startswith("encoder.")]
    opt = torch.optim.AdamW([{"params": list(model.encoder.parameters()), "lr": tc.lr},
                             {"params": head, "lr": tc.head_lr}], weight_decay=tc.weight_decay)
    per_epoch = -(-len(items) // tc.batch_size)
    total = per_epoch * tc.epochs
    warm = max(1, int(total * tc.warmup))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, max(0.0, (total - s) / max(1, total - warm))))
    eval_at = {max(1, round(per_epoch * (j + 1) / tc.evals_per_epoch)) for j in range(tc.evals_per_epoch)}
    history: list[dict[str, Any]] = []
    best: tuple[float, dict[str, torch.Tensor]] | None = None
    t0 = time.perf_counter()
    step, running = 0, 0.0
    for epoch in range(tc.epochs):
        for b, batch in enumerate(batches(items, tc.batch_size, rng), 1):
            logits = score_items(model, tokenizer, [(it.prompt, it.choices) for it in batch], tc.device)
            loss = loss_of(logits, [it.label for it in batch])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            last = float(loss.detach())
            running += last
            if step % tc.log_every == 0:
                log(f"step {step}/{total}  loss {running / tc.log_every:.4f}  {time.perf_counter() - t0:.0f}s")
                running = 0.0
            if b in eval_at:
                acc = accuracy(model, tokenizer, dev_items, tc.device)
                history.append({"epoch": epoch + b / per_epoch, "step": step, "dev_accuracy": round(acc, 4),
                                "loss": round(last, 4), "seconds": round(time.perf_counter() - t0, 1)})
                log(f"epoch {epoch + b / per_epoch:.2f}  dev accuracy {acc:.4f}")
                if best is None or acc > best[0]:
                    best = (acc, copy.deepcopy({k: v.detach().cpu() for k, v in model.state_dict().items()}))
    assert best is not None
    model.load_state_dict(best[1])
    model.cpu().eval()
    summary = {"train_items": len(items), "dev_items": len(dev_items), "best_dev_accuracy": round(best[0], 4),
               "history": history, "seconds": round(time.perf_counter() - t0, 1), "train": asdict(tc),
               "data": str(Path(data).expanduser().resolve()), "dev": None if dev is None else str(dev)}
    with atomic_output(Path(out), force) as tmp:
        save_duma(model, tokenizer, tmp, extra={"training": summary})
    log(f"wrote {out}: {cfg.head}{'' if cfg.head == 'baseline' else ' (' + cfg.fuse + ')'} head, best dev accuracy "
        f"{best[0]:.4f}, {summary['seconds']:.0f}s")
    return summary
