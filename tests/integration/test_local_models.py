"""Models from local paths: a Hugging Face checkpoint directory, and a GGUF file prepared on demand."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from chorus.config import ChorusConfig
from chorus.engines.core.registry import prepare_model
from chorus.engines.core.sources import smollm2_gguf
from chorus.engines.core.spec import ModelSpec
from chorus.engines.transformers.prepare import is_prepared
from tests.helpers import SMOL, gateway

pytestmark = pytest.mark.integration


def test_local_checkpoint_and_gguf(default_config: ChorusConfig, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    hf_dir = default_config.model(SMOL).prepared_dir()
    monkeypatch.setenv("CHORUS_HOME", str(tmp_path))  # the GGUF is prepared into a fresh cache
    gguf_spec = ModelSpec(name="my-gguf", path=str(smollm2_gguf(tmp_path)))
    lines: list[str] = []
    prepare_model(gguf_spec, log=lines.append)
    assert is_prepared(gguf_spec.prepared_dir()) and any("[4/4]" in ln for ln in lines)
    config = ChorusConfig.model_validate({"models": [{"name": "my-dir", "path": str(hf_dir)},
                                                     gguf_spec.model_dump(exclude_none=True)]})
    with gateway(config) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        answers = [client.chat.completions.create(
            model=m, messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0, max_tokens=12).choices[0].message.content for m in ("my-dir", "my-gguf")]
        assert answers[0] == answers[1] and "Paris" in answers[0]


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": [{"type": "text", "text": "Two "}, {"type": "text", "text": "parts"}]}],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "Ünïcode ✓ <|im_end|> {{ not a template }}\n\n  spaces  "}],
]


@pytest.mark.parametrize("model", [SMOL, "gemma-3-270m"])
def test_fast_chat_encoding_equals_transformers(default_config: ChorusConfig, model: str) -> None:
    """The gateway renders with the compiled template and encodes on the Rust backend: same text, same ids
    as transformers' apply_chat_template + encode (SmolLM2's own template, Gemma's fallback)."""
    from transformers import AutoTokenizer

    from chorus.engines.core.hf_tokenizer import HFTokenizer, message_text

    tok = HFTokenizer(AutoTokenizer.from_pretrained(default_config.model(model).checkpoint_dir()))
    assert tok._template is not None
    for chat in CHATS:
        msgs = [{"role": m["role"], "content": message_text(m["content"])} for m in chat]
        want_text = tok.render_chat_hf(msgs)
        assert tok.render_chat(chat) == want_text
        assert tok.encode_chat(chat) == list(tok.hf.encode(want_text, add_special_tokens=tok.uses_fallback_template))


def test_a_base_model_chats_after_the_few_shot_preamble_unless_plain(default_config: ChorusConfig) -> None:
    """Gemma-3-270M has no chat template: by default its chat prompt is the few-shot preamble then the transcript
    (it answered 4 of the 5 newcomer questions so, none with the bare transcript); ``fallback_chat: plain`` keeps
    the bare one."""
    from transformers import AutoTokenizer

    from chorus.engines.core.hf_tokenizer import FEW_SHOT_PREAMBLE, HFTokenizer
    from chorus.engines.core.spec import ModelSpec

    hf = AutoTokenizer.from_pretrained(default_config.model("gemma-3-270m").checkpoint_dir())
    chat = [{"role": "user", "content": "Name a river."}]
    few, plain = HFTokenizer(hf).render_chat(chat), HFTokenizer(hf, fallback="plain").render_chat(chat)
    assert few == FEW_SHOT_PREAMBLE + plain and plain == "User: Name a river.\nAssistant:"
    assert default_config.model("gemma-3-270m").fallback_chat == "few_shot"
    with pytest.raises(ValueError, match="fallback_chat"):
        ModelSpec.model_validate({"name": "x", "engine": "fake", "fallback_chat": "zero_shot"})
