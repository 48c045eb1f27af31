"""A Hugging Face tokenizer behind chorus's `Tokenizer` protocol, with the fallback chat template."""

from __future__ import annotations

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


def message_text(content: Any) -> str:
    """OpenAI message content: a string or a list of parts; text parts are joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text")


class HFTokenizer:
    def __init__(self, tok: Any, extra_eos_ids: Sequence[int] = ()) -> None:
        self.hf = tok
        self.uses_fallback_template = not getattr(tok, "chat_template", None)
        eos = {i for i in [tok.eos_token_id, *extra_eos_ids] if i is not None}
        self.eos_token_ids = frozenset(eos)
        self._fingerprint: str | None = None

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
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        msgs = [{"role": m["role"], "content": message_text(m.get("content"))} for m in messages]
        template = FALLBACK_CHAT_TEMPLATE if self.uses_fallback_template else None
        return self.hf.apply_chat_template(msgs, chat_template=template, tokenize=False, add_generation_prompt=True)

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Rendered chat to ids. A model's own template writes its special tokens itself; the fallback
        template is plain text, so the tokenizer adds its usual BOS."""
        return list(self.hf.encode(self.render_chat(messages), add_special_tokens=self.uses_fallback_template))
