"""``logit_bias`` (OpenAI: token id -> bias in [-100, 100], added to the logits before sampling) on the fake
engines, with the openai SDK: it steers the output, ids outside the vocabulary and malformed maps are a 400
naming it, ensembles refuse it, remote engines send it on."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from chorus.engines.core.base import GenerationRequest, SamplingParams
from chorus.engines.fake.engine import CharTokenizer
from chorus.engines.remote.openai_wire import request_body
from tests.helpers import LiveServer

USER = [{"role": "user", "content": "hi"}]
Z = CharTokenizer().encode("z")[0]


def test_a_large_bias_forces_a_token_and_a_negative_one_bans_it(client: openai.OpenAI, server: LiveServer) -> None:
    forced = client.chat.completions.create(model="fake", messages=USER, max_tokens=5, temperature=0,
                                            logit_bias={str(Z): 100})
    assert forced.choices[0].message.content == "zzzzz"
    free = client.completions.create(model="scripted", prompt="x", max_tokens=8, temperature=0)
    first = CharTokenizer().encode(free.choices[0].text[0])[0]
    banned = client.completions.create(model="scripted", prompt="x", max_tokens=8, temperature=0,
                                       logit_bias={str(first): -100})
    assert free.choices[0].text[0] not in banned.choices[0].text


@pytest.mark.parametrize("bias,words", [
    ({"99999": 1}, "outside the vocabulary"),
    ({"abc": 1}, "token ids"),
    ({str(Z): 150}, "between -100 and 100"),
])
def test_bad_biases_are_a_400(client: openai.OpenAI, bias: dict[str, Any], words: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="fake", messages=USER, max_tokens=2, logit_bias=bias)
    err = info.value.body
    assert isinstance(err, dict) and err["param"] == "logit_bias" and words in err["message"], err


def test_ensembles_refuse_a_bias(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="fake", messages=USER, max_tokens=2, logit_bias={str(Z): 5},
                                       extra_body={"ensemble": {"strategy": "logit_average",
                                                                "members": ["fake", "scripted"]}})
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "logit_bias"


def test_remote_engines_send_it_on() -> None:
    req = GenerationRequest([1, 2], SamplingParams(logit_bias=((Z, -3.0),)))
    _, body = request_body(req, False, model="m", upstream_model="up", api="completions")
    assert body["logit_bias"] == {str(Z): -3.0}
