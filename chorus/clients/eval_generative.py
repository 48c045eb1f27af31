"""Labelled generative items for learned routing: each member answers every item once through a running chorus,
and its outcome (the text, right or not, tokens, seconds) is cached per item as ``chorus eval --cache`` caches
choice scores, so training and the protocol rerun without calling a model again.

Rows (JSONL), one of two shapes, each with a short reference ``answer``:

* ``{"prompt": ..., "answer": ...}``: the prompt is sent as it is to ``/v1/completions`` (greedy, stopped at
  the line's end, ``--max-tokens``); right when the first number of the completion equals the answer (a
  number), else when the completion's first line, stripped, equals it. ``chorus eval addition --write FILE``
  writes the seeded addition set in this shape.
* ``{"question": ..., "answer": ...}`` (GSM8K's rows as they are): sent to ``/v1/chat/completions`` with
  ``chorus eval``'s instruction; right when the extracted answer ("the answer is X") equals the reference
  (GSM8K's ``#### 72`` reduced to ``72``).

The text a router reads is the prompt, or the question with the instruction: what the served ``route``
strategy sees as the request's last user message.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from chorus.clients.eval_choices import cache_file, read_cache
from chorus.ensembles.answers.extract import extract_answer

INSTRUCTION = 'Solve the problem step by step, and end with "The answer is X".'
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass
class GenItem:
    id: str
    text: str  #: what is sent: the completion prompt, or the chat question with the instruction
    answer: str  #: the reference, reduced (GSM8K's "#### 72" -> "72")
    chat: bool


def is_generative(path: Path) -> bool:
    with path.open() as f:
        first = json.loads(next((line for line in f if line.strip()), "{}"))
    return isinstance(first, dict) and "answer" in first and ("prompt" in first or "question" in first) \
        and "choices" not in first


def reference(answer: Any) -> str:
    text = str(answer)
    if "####" in text:
        text = text.split("####")[-1]
    return text.strip().replace(",", "")


def load_gen_items(path: Path, offset: int = 0, limit: int | None = None,
                   instruction: str = INSTRUCTION) -> list[GenItem]:
    items: list[GenItem] = []
    with path.open() as f:
        rows = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    for n, line in rows[offset:]:
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or "answer" not in row:
                raise ValueError("need 'answer'")
            if isinstance(row.get("prompt"), str):
                items.append(GenItem(str(row.get("id", n)), row["prompt"], reference(row["answer"]), False))
            elif isinstance(row.get("question"), str):
                items.append(GenItem(str(row.get("id", n)), f"{row['question']}\n\n{instruction}",
                                     reference(row["answer"]), True))
            else:
                raise ValueError("need a text 'prompt' or 'question'")
        except (json.JSONDecodeError, ValueError) as exc:
            raise SystemExit(f"chorus: {path}:{n}: a generative row needs 'prompt' or 'question' and 'answer' "
                             f"({exc})") from None
        if limit is not None and len(items) >= limit:
            break
    return items


def request(text: str, chat: bool, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The path (under ``/v1``) and body that send ``text``: a user turn to chat completions, or a prompt to
    completions stopped at the line's end (``chorus eval gsm8k --items`` sends its rows the same way)."""
    if chat:
        return "/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}
    return "/completions", {**body, "prompt": text, "stop": ["\n"]}


def choice_text(choice: dict[str, Any], chat: bool) -> str:
    return (choice["message"]["content"] if chat else choice["text"]) or ""


def first_number(text: str) -> str:
    """A completion's answer: its first number, canonical as `extract_answer` writes numbers ("10599.0" is
    "10599"; "" when none)."""
    m = NUMBER.search(text)
    return extract_answer(m.group(), "number") if m else ""


def is_right(item: GenItem, text: str) -> bool:
    if item.chat:
        return extract_answer(text, "number") == extract_answer("The answer is " + item.answer, "number")
    if NUMBER.fullmatch(item.answer):
        got = first_number(text)
        return got != "" and float(got) == float(item.answer)
    return text.strip().split("\n")[0].strip().lower() == item.answer.lower()


async def answer_item(http: httpx.AsyncClient, model: str, item: GenItem, max_tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    path, body = request(item.text, item.chat, {"model": model, "temperature": 0, "max_tokens": max_tokens})
    r = await http.post(path, json=body)
    if r.status_code != 200:
        raise SystemExit(f"chorus: {model} on item {item.id}: {r.status_code}: {r.text[:300]}")
    data = r.json()
    text = choice_text(data["choices"][0], item.chat)
    return {"id": item.id, "text": text, "right": int(is_right(item, text)),
            "usage_tokens": data["usage"]["total_tokens"], "calls": 1, "seconds": time.perf_counter() - t0}


async def run_member(http: httpx.AsyncClient, model: str, items: list[GenItem], cached: Path,
                     concurrency: int, max_tokens: int) -> list[dict[str, Any]]:
    have = read_cache(cached)
    todo = [it for it in items if it.id not in have]
    print(f"{model}: {len(items)} items, {len(items) - len(todo)} cached", file=sys.stderr, flush=True)
    cached.parent.mkdir(parents=True, exist_ok=True)
    gate = asyncio.Semaphore(concurrency)
    with cached.open("a") as out:
        async def one(item: GenItem) -> None:
            async with gate:
                rec = await answer_item(http, model, item, max_tokens)
            have[item.id] = rec
            out.write(json.dumps(rec) + "\n")
            out.flush()

        await asyncio.gather(*(one(it) for it in todo))
    return [have[it.id] for it in items]


def member_outcomes(url: str, data: Path, members: list[str], cache: Path, *, offset: int = 0,
                    limit: int | None = None, concurrency: int = 1, max_tokens: int = 16, timeout: float = 600.0,
                    headers: dict[str, str] | None = None) -> tuple[list[GenItem], np.ndarray, np.ndarray]:
    """The items of ``data``, whether each member was right on each and its seconds on each (both (items,
    members); answered through ``url`` where the cache does not have them)."""
    items = load_gen_items(data, offset, limit)
    if not items:
        raise SystemExit(f"chorus: no items in {data}")

    async def run() -> list[list[dict[str, Any]]]:
        async with httpx.AsyncClient(base_url=url, timeout=timeout, headers=headers or {}) as http:
            return [await run_member(http, m, items, cache_file(cache, data, m), concurrency, max_tokens)
                    for m in members]

    runs = asyncio.run(run())
    right = np.array([[rec["right"] for rec in recs] for recs in runs], dtype=int).T
    return items, right, np.array([[rec["seconds"] for rec in recs] for recs in runs], dtype=float).T
