"""A Hugging Face tokenizer behind chorus's `Tokenizer` protocol, with the fallback chat template."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from typing import Any

#: Used for models whose tokenizer has no chat template (base models such as gemma-3-270m).
#: A plain "User:/Assistant:" transcript; generation stops at the next "\nUser:" turn.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n"
    "{% else %}Assistant: {{ message['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
FALLBACK_STOP = ("\nUser:",)
#: The same transcript after five short worked exchanges (``fallback_chat: few_shot``, the default): a base model
#: that continues a bare transcript by repeating the question (Gemma-3-270M did, on every question of the newcomer
#: set) answers after these (4 of 5; docs/configuration.md). About 110 tokens, a prefix every request shares.
FEW_SHOT_PREAMBLE = (
    "A conversation between a user and a helpful assistant. The assistant answers briefly and correctly.\n\n"
    "User: What is the capital of Italy? Answer in one word.\nAssistant: Rome\n"
    "User: What is 3 + 4?\nAssistant: 3 + 4 = 7.\n"
    "User: Is ice cold? Answer yes or no.\nAssistant: Yes.\n"
    "User: Write one sentence about the moon.\nAssistant: The moon lights up the night sky.\n"
    'User: Reply with a JSON object with a key "animal".\nAssistant: {"animal": "cat"}\n\n'
)
FEW_SHOT_CHAT_TEMPLATE = FEW_SHOT_PREAMBLE + FALLBACK_CHAT_TEMPLATE


def message_text(content: Any) -> str:
    """OpenAI message content: a string or a list of parts; text parts are joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text")


def has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    """Whether a conversation holds function-calling turns (assistant ``tool_calls``, ``role: tool``)."""
    return any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


class HFTokenizer:
    def __init__(self, tok: Any, extra_eos_ids: Sequence[int] = (), fallback: str = "few_shot") -> None:
        self.hf = tok
        self.uses_fallback_template = not getattr(tok, "chat_template", None)
        #: a model without a chat template of its own chats through this one (``fallback_chat`` in its entry)
        self.fallback_template = FEW_SHOT_CHAT_TEMPLATE if fallback == "few_shot" else FALLBACK_CHAT_TEMPLATE
        template = getattr(tok, "chat_template", None)
        #: the model's own template renders tools, tool calls and tool results (Qwen2.5's does)
        self.supports_tools = isinstance(template, str) and "tool_calls" in template and "tools" in template
        eos = {i for i in [tok.eos_token_id, *extra_eos_ids] if i is not None}
        self.eos_token_ids = frozenset(eos)
        self._fingerprint: str | None = None
        self._template = self._compiled_template()
        self._fast_decode = self._backend_decode()

    def _backend_decode(self) -> Any:
        """The Rust tokenizer's own decode when transformers' would only wrap it (a fast tokenizer, no clean-up of
        spaces): the same text at a fifth of the cost, which the stream pays twice a token. None: use ``decode``
        of transformers."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None or getattr(self.hf, "clean_up_tokenization_spaces", True):
            return None
        return functools.partial(backend.decode, skip_special_tokens=True)

    def _compiled_template(self) -> Any:
        """The chat template compiled once, rendered with what ``apply_chat_template`` passes (the special
        tokens, ``add_generation_prompt``); HF's own call does more bookkeeping per request (~half of the
        render time, measured). None: use ``apply_chat_template`` (no template, or transformers moved it)."""
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template
        except ImportError:  # pragma: no cover - transformers reorganised
            return None
        template = self.fallback_template if self.uses_fallback_template else self.hf.chat_template
        if not isinstance(template, str):
            return None  # several named templates: let transformers pick
        compiled = _compile_jinja_template(template)
        extra = dict(self.hf.special_tokens_map)
        return lambda msgs: compiled.render(messages=msgs, tools=None, documents=None, add_generation_prompt=True,
                                            **extra)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def fingerprint(self) -> str:
        """Hash of the token-id -> token-string map: equal fingerprints mean a shared vocabulary."""
        if self._fingerprint is None:
            vocab = sorted(self.hf.get_vocab().items(), key=lambda kv: kv[1])
            h = hashlib.sha256()
            for token, idx in vocab:
                h.update(f"{idx}\x00{token}\x01".encode())
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    @property
    def chat_stop(self) -> tuple[str, ...]:
        return FALLBACK_STOP if self.uses_fallback_template else ()

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=True))

    def encode_text(self, text: str) -> list[int]:
        """A piece of text without special tokens (e.g. a string to feed mid-sequence)."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def token_strings(self) -> list[str]:
        """Every token id's text (special tokens: empty)."""
        return self.hf.batch_decode([[i] for i in range(self.vocab_size)], skip_special_tokens=True)

    def decode(self, ids: Sequence[int]) -> str:
        if self._fast_decode is not None:
            return str(self._fast_decode(list(ids)))
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        if self.supports_tools and (tools or has_tool_turns(messages)):
            # the template reads tool calls and tool results: every message field goes through
            msgs = [{**m, "content": message_text(m.get("content"))} for m in messages]
            return str(self.hf.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True))
        if tools:
            raise ValueError("this model's chat template has no tools: engines/core/tool_calls.py renders them")
        msgs = [{"role": m["role"], "content": message_text(m.get("content"))} for m in messages]
        if self._template is not None:
            return self._template(msgs)
        return self.render_chat_hf(msgs)

    def render_chat_hf(self, msgs: list[dict[str, Any]]) -> str:
        """transformers' own rendering (the reference the fast path is tested against)."""
        template = self.fallback_template if self.uses_fallback_template else None
        return self.hf.apply_chat_template(msgs, chat_template=template, tokenize=False, add_generation_prompt=True)

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Rendered chat to ids. A model's own template writes its special tokens itself; the fallback
        template is plain text, so the tokenizer adds its usual BOS. Fast tokenizers are called on their
        Rust backend directly (the same ids, without the Python ``encode`` wrapper: ~40% of the cost)."""
        text = self.render_chat(messages, tools)
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is not None:
            return backend.encode(text, add_special_tokens=self.uses_fallback_template).ids
        return list(self.hf.encode(text, add_special_tokens=self.uses_fallback_template))
