"""A deterministic engine with no model, shipped beside the real one (as httpx ships MockTransport).

`FakeEngine` runs the same decode loop as the transformers engine over scripted logits, so unit tests
exercise sampling, stop strings, streaming and errors without loading weights. Its tokenizer is
character level: one token per printable ASCII character, plus ``<eos>``.

The next-token logits of a session are a function of the text so far:
- with ``script``: the next character of the script is favoured (peak ``sharpness``), then ``<eos>``;
- with ``reply`` (a function of the prompt text): as with a script, the reply to this prompt;
- with ``replies``: session ``i`` of the engine (in the order they are opened) is scripted with
  ``replies[i % len(replies)]``: ``n`` samples of one prompt get different replies (answer-side ensembles);
- without: the next character is the one after the last (``a`` -> ``b``), so outputs are predictable.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from chorus.engines.core.base import check_rollback
from chorus.engines.core.generation import SessionEngine
from chorus.engines.core.request_scope import UNSCOPED, RequestScope
from chorus.engines.core.spec import ModelSpec
from chorus.engines.fake.options import FakeOptions
from chorus.errors import ContextLengthExceeded, EngineFailed

_CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
EOS_TOKEN = "<eos>"


class CharTokenizer:
    """One token per character; unknown characters map to ``?``."""

    def __init__(self) -> None:
        self.vocab = [*_CHARS, EOS_TOKEN]
        self._ids = {c: i for i, c in enumerate(self.vocab)}
        self.eos_id = self._ids[EOS_TOKEN]
        self.eos_token_ids = frozenset({self.eos_id})

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256("\x00".join(self.vocab).encode()).hexdigest()[:16]

    @property
    def chat_stop(self) -> tuple[str, ...]:
        return ()

    def encode(self, text: str) -> list[int]:
        return [self._ids.get(c, self._ids["?"]) for c in text]

    def encode_text(self, text: str) -> list[int]:
        return self.encode(text)

    def token_strings(self) -> list[str]:
        return [self.decode([i]) for i in range(self.vocab_size)]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.vocab[i] for i in ids if i != self.eos_id)

    supports_tools = False  # tools reach it as the fallback system message (engines/core/tool_calls.py)

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        if tools:
            raise ValueError("the character tokenizer's template has no tools")
        lines = [f"{m['role']}: {m.get('content') or ''}" for m in messages]
        return "\n".join(lines) + "\nassistant:"

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        return self.encode(self.render_chat(messages, tools))


class FakeSession:
    def __init__(self, engine: FakeEngine) -> None:
        self._engine = engine
        self._ids: list[int] = []
        self._prompt_len = 0
        self._script = engine.script
        if engine.replies:
            self._script = engine.replies[engine.opened % len(engine.replies)]
        engine.opened += 1
        self._closed = False
        engine._open.add(self)

    @property
    def length(self) -> int:
        return len(self._ids)

    async def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        self._ids = list(ids)
        self._prompt_len = len(self._ids)
        if self._engine.reply is not None:
            self._script = self._engine.reply(self._engine.tokenizer.decode(self._ids))
        return await self._logits()

    async def step(self, token: int) -> torch.Tensor:
        self._ids.append(token)
        return await self._logits()

    async def extend(self, ids: Sequence[int]) -> torch.Tensor:
        """Several tokens in one (scripted) forward: one delay, one step counted."""
        self._ids.extend(int(t) for t in ids)
        return await self._logits(len(ids))

    def rollback(self, n: int) -> None:
        check_rollback(n, len(self._ids))
        del self._ids[len(self._ids) - n :]

    def close(self) -> None:
        self._closed = True
        self._engine._open.discard(self)

    async def _logits(self, rows: int = 0) -> torch.Tensor:
        """The next-token logits after the text so far (``rows``: after each of the last ``rows`` tokens)."""
        eng = self._engine
        if self._closed:
            raise EngineFailed("session is closed")
        if len(self._ids) > eng.max_model_len:
            raise ContextLengthExceeded(f"session exceeds the context window of {eng.max_model_len} tokens")
        eng.steps += 1
        if eng.fail_after is not None and eng.steps > eng.fail_after:
            raise RuntimeError("scripted engine failure")
        await asyncio.sleep(eng.delay)
        if rows:
            return torch.stack([self._after(len(self._ids) - rows + 1 + j) for j in range(rows)])
        return self._after(len(self._ids))

    def _after(self, n: int) -> torch.Tensor:
        """The logits after the first ``n`` ids."""
        eng = self._engine
        tok = eng.tokenizer
        logits = torch.zeros(tok.vocab_size)
        produced = n - self._prompt_len
        if self._script is not None:
            nxt = tok.encode(self._script[produced])[0] if produced < len(self._script) else tok.eos_id
        else:
            last = tok.vocab[self._ids[n - 1]] if n else "a"
            nxt = tok.encode(chr((ord(last) - 97 + 1) % 26 + 97))[0] if last.isalpha() else tok.encode("a")[0]
        logits[nxt] = eng.sharpness
        # a second-best token so sampling at high temperature has something to choose
        logits[(nxt + 1) % (tok.vocab_size - 1)] = eng.sharpness / 2
        return logits


class FakeEngine(SessionEngine):
    tokenizer: CharTokenizer

    @classmethod
    def load(cls, spec: ModelSpec, models: dict[str, ModelSpec] | None = None) -> FakeEngine:
        """``engine: fake`` in a config (options under ``fake:``: script, delay, max_model_len, ...)."""
        assert isinstance(spec.options, FakeOptions)
        return cls(spec.name, sampling_defaults=spec.sampling_defaults.model_dump(exclude_none=True),
                   **spec.options.model_dump())

    def __init__(self, name: str = "fake", *, script: str | None = None, delay: float = 0.0,
                 max_model_len: int = 256, sharpness: float = 10.0, fail_after: int | None = None,
                 sampling_defaults: dict[str, float] | None = None,
                 reply: Callable[[str], str] | None = None, replies: Sequence[str] | None = None) -> None:
        self.name = name
        self.reply = reply
        self.replies = list(replies or [])
        self.opened = 0  # sessions opened so far (``replies`` cycles through them)
        self.scope = UNSCOPED  #: the last session's request scope (what a test reads of it)
        self.sampling_defaults = dict(sampling_defaults or {})
        self.script = script
        self.delay = delay
        self.max_model_len = max_model_len
        self.sharpness = sharpness
        self.fail_after = fail_after
        self.steps = 0
        self.tokenizer = CharTokenizer()
        self._open: set[FakeSession] = set()

    def open_session(self, scope: RequestScope | None = None) -> FakeSession:
        self.scope = scope or UNSCOPED
        return FakeSession(self)

    @property
    def active_sessions(self) -> int:
        return len(self._open)
