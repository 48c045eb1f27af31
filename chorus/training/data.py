"""Training text for the trainers (MoDr, MoE, ReasonFormer): JSONL rows read as text, packed into fixed-length
sequences (or kept one row per sequence)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from chorus.errors import BuildError


def read_texts(path: Path, rows: slice | None = None) -> list[str]:
    """JSONL rows: {"text"}, {"prompt", "completion"}, {"question", "answer"}, {"messages"}, or a multiple-choice
    item ({"choices", "label"} with a "question" / "goal" or a "context") as its prompt and right answer in the
    format chorus's multiple-choice evaluation scores (``Question: ...\nAnswer: <choice>``, or ``<context> <choice>``);
    ``rows`` keeps a slice of the file's non-empty rows (a held-out split)."""
    if not path.is_file():
        raise BuildError(f"training data {path} does not exist")
    texts = []
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    for n, line in lines[rows] if rows is not None else lines:
        try:
            row = json.loads(line)
        except ValueError:
            raise BuildError(f"{path}:{n} is not JSON") from None
        if "text" in row:
            texts.append(str(row["text"]))
        elif "prompt" in row and "completion" in row:
            texts.append(f"{row['prompt']}{row['completion']}")
        elif "choices" in row and "label" in row:
            texts.append(choice_text(row, path, n))
        elif "question" in row and "answer" in row:
            texts.append(f"Question: {row['question']}\nAnswer: {row['answer']}")
        elif "messages" in row:
            texts.append("\n".join(f"{m['role']}: {m['content']}" for m in row["messages"]))
        else:
            raise BuildError(f"{path}:{n}: expected a 'text', 'prompt'+'completion', 'question'+'answer', "
                             "'messages' or 'choices'+'label' field")
    if not texts:
        raise BuildError(f"{path} holds no training rows")
    return texts


def choice_text(row: dict, path: Path, n: int) -> str:
    try:
        answer = row["choices"][int(row["label"])]
    except (IndexError, TypeError, ValueError):
        raise BuildError(f"{path}:{n}: 'label' does not index 'choices'") from None
    question = row.get("question", row.get("goal"))
    if "context" in row:
        return f"{row['context']}\nQuestion: {question}\nAnswer: {answer}" if question else f"{row['context']} {answer}"
    if question is None:
        raise BuildError(f"{path}:{n}: a multiple-choice row needs a 'question', 'goal' or 'context'")
    return f"Question: {question}\nAnswer: {answer}"


def parse_rows(spec: str) -> tuple[Path, slice | None]:
    """``PATH`` or ``PATH@START:END`` (a slice of the file's rows, either end optional)."""
    path, _, rng = spec.rpartition("@") if "@" in spec else (spec, "", "")
    if not rng:
        return Path(path).expanduser(), None
    try:
        a, b = (int(x) if x else None for x in rng.split(":"))
    except ValueError:
        raise BuildError(f"{spec!r}: the rows after '@' must be START:END (e.g. @0:900 or @900:)") from None
    return Path(path).expanduser(), slice(a, b)


def pad_rows(ids: list[list[int]], pad: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One row per sequence (truncated to ``seq_len``), right-padded: ids (N, T) and the real-token mask (N, T)."""
    rows = [r[:seq_len] for r in ids]
    t = max(len(r) for r in rows)
    out = torch.full((len(rows), t), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), t, dtype=torch.bool)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = True
    return out, mask


def pack(ids: list[list[int]], eos: int, seq_len: int) -> torch.Tensor:
    flat = [t for row in ids for t in [*row, eos]]
    n = len(flat) // seq_len
    if n < 2:
        raise BuildError(f"the data gives {len(flat)} tokens: fewer than two sequences of {seq_len}")
    return torch.tensor(flat[: n * seq_len]).view(n, seq_len)  # (N, T)
