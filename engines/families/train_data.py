"""Training text for the trainers (MoDr, MoE): JSONL rows read as text, packed into fixed-length sequences."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from chorus.errors import BuildError


def read_texts(path: Path) -> list[str]:
    """JSONL rows: {"text"}, {"prompt", "completion"}, {"question", "answer"} or {"messages"}."""
    if not path.is_file():
        raise BuildError(f"training data {path} does not exist")
    texts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise BuildError(f"{path}:{n} is not JSON") from None
        if "text" in row:
            texts.append(str(row["text"]))
        elif "prompt" in row and "completion" in row:
            texts.append(f"{row['prompt']}{row['completion']}")
        elif "question" in row and "answer" in row:
            texts.append(f"Question: {row['question']}\nAnswer: {row['answer']}")
        elif "messages" in row:
            texts.append("\n".join(f"{m['role']}: {m['content']}" for m in row["messages"]))
        else:
            raise BuildError(f"{path}:{n}: expected a 'text', 'prompt'+'completion', 'question'+'answer' or "
                             "'messages' field")
    if not texts:
        raise BuildError(f"{path} holds no training rows")
    return texts


def pack(ids: list[list[int]], eos: int, seq_len: int) -> torch.Tensor:
    flat = [t for row in ids for t in [*row, eos]]
    n = len(flat) // seq_len
    if n < 2:
        raise BuildError(f"the data gives {len(flat)} tokens: fewer than two sequences of {seq_len}")
    return torch.tensor(flat[: n * seq_len]).view(n, seq_len)  # (N, T)
