"""Unit tests of chorus's vLLM plugin (chorus/engines/families/on_vllm), run by vLLM's own Python: ``make test``
runs them with ``.venv-vllm/bin/python -m pytest tests/plugin`` (``make vllm`` installs chorus and pytest there).
chorus's own venv has no vLLM and skips them. The end-to-end check (vLLM serving each family token for token as
chorus's engine does) is tests/integration/test_vllm_families.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="runs under vLLM's Python (make test runs tests/plugin there)")

import torch

from chorus.engines.families import on_vllm
from chorus.engines.families.on_vllm import over_base, reasonformer

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100,
         "rms_norm_eps": 1e-5, "max_position_embeddings": 256, "tie_word_embeddings": True}


def family_dir(tmp_path: Path, base: dict[str, Any], model_type: str = "chorus_modr") -> Path:
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text(json.dumps(base))
    (tmp_path / "fam").mkdir()
    (tmp_path / "fam" / "config.json").write_text(json.dumps({
        "model_type": model_type, "architectures": ["MoDrModel"], "base": str(tmp_path / "base"),
        "modr": {"prelude": [0, 1], "core": [1, 3], "coda": [3, 4], "recurrence": 2}, "hidden_size": 64}))
    return tmp_path / "fam"


def test_register_teaches_vllm_both_families(tmp_path: Path) -> None:
    from transformers import AutoConfig
    from vllm import ModelRegistry

    on_vllm.register()
    on_vllm.register()  # idempotent (vLLM runs the hook in every process)
    assert {"MoDrModel", "ReasonFormerModel"} <= set(ModelRegistry.get_supported_archs())
    cfg = AutoConfig.from_pretrained(family_dir(tmp_path, LLAMA))
    assert type(cfg).__name__ == "MoDrHFConfig"
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.vocab_size) == (4, 2, 100)  # the base's
    assert cfg.modr["core"] == [1, 3] and cfg.base_dir == str((tmp_path / "base").resolve())
    again = type(cfg).from_dict(cfg.to_dict())  # vLLM copies configs between processes
    assert again.num_hidden_layers == 4 and again.base_dir == cfg.base_dir


def test_config_errors_say_what_is_wrong(tmp_path: Path) -> None:
    from transformers import AutoConfig

    on_vllm.register()
    d = family_dir(tmp_path, {**LLAMA, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="not a Llama checkpoint"):
        AutoConfig.from_pretrained(d)
    (tmp_path / "base" / "config.json").unlink()
    with pytest.raises(ValueError, match="base .* is missing"):
        AutoConfig.from_pretrained(d)


def test_sequences_of_a_flat_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    meta = SimpleNamespace(query_start_loc=torch.tensor([0, 3, 4, 6]))
    monkeypatch.setattr(over_base, "get_forward_context", lambda: SimpleNamespace(attn_metadata={"l0": meta}))
    seg, n = over_base.sequences(7, torch.device("cpu"))  # 3 sequences (a prefill, two more) and a padding token
    assert seg.tolist() == [0, 0, 0, 1, 2, 2, 3] and n == 4
    x = torch.arange(14, dtype=torch.float32).view(7, 2)
    assert over_base.sequence_mean(x, seg, n).tolist() == [[2, 3], [6, 7], [9, 10], [12, 13]]
    monkeypatch.setattr(over_base, "get_forward_context", lambda: SimpleNamespace(attn_metadata=None))
    seg, n = over_base.sequences(5, torch.device("cpu"))  # vLLM's dummy runs: one sequence
    assert seg.tolist() == [0] * 5 and n == 1


def test_lora_delta_is_each_tokens_own_entry() -> None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 4, 8, generator=g), torch.randn(3, 6, 4, generator=g)
    x, pick = torch.randn(5, 8, generator=g), torch.tensor([0, 2, 2, 1, 0])
    scale = torch.tensor([1.0, 0.5, 2.0, 0.0, 1.5])
    got = over_base.LoRADelta(a, b)(x, pick, scale)
    want = torch.stack([scale[n] * b[pick[n]] @ (a[pick[n]] @ x[n]) for n in range(5)])
    torch.testing.assert_close(got, want)


def test_fused_qkv_delta_is_q_k_v_side_by_side() -> None:
    g = torch.Generator().manual_seed(1)
    sizes, rank, entries, hidden = (8, 4, 4), 2, 3, 8
    parts = [(torch.randn(entries, rank, hidden, generator=g), torch.randn(entries, s, rank, generator=g))
             for s in sizes]
    parts[1] = None  # type: ignore[call-overload]  # no LoRA on k
    fused = over_base.stack_qkv(parts, sizes, rank, entries, hidden)  # type: ignore[arg-type]
    x, pick, scale = torch.randn(4, hidden, generator=g), torch.tensor([0, 1, 2, 1]), torch.ones(4)
    want = torch.cat([over_base.LoRADelta(*parts[0])(x, pick, scale), torch.zeros(4, 4),  # type: ignore[misc]
                      over_base.LoRADelta(*parts[2])(x, pick, scale)], -1)  # type: ignore[misc]
    torch.testing.assert_close(fused(x, pick, scale), want)


@pytest.mark.parametrize(("change", "message"), [
    ({"enforce_eager": False}, "--enforce-eager"),
    ({"enable_prefix_caching": True}, "--no-enable-prefix-caching"),
])
def test_settings_the_plugin_cannot_serve_are_refused(change: dict[str, bool], message: str) -> None:
    settings = {"enforce_eager": True, "enable_prefix_caching": False, **change}
    cfg: Any = SimpleNamespace(model_config=SimpleNamespace(enforce_eager=settings["enforce_eager"]),
                               cache_config=SimpleNamespace(enable_prefix_caching=settings["enable_prefix_caching"]))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(over_base, "get_tensor_model_parallel_world_size", lambda: 1)
        with pytest.raises(ValueError, match=message):
            over_base.check_serving(cfg, "MoDr")


def test_the_wrapped_runner_names_each_sequences_request() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    reasonformer.track_requests()
    reasonformer.track_requests()  # wraps once
    seen: list[list[str]] = []
    runner: Any = SimpleNamespace(input_batch=SimpleNamespace(req_ids=["a", "b", None]),
                                  model=lambda **kw: seen.append(list(reasonformer.BATCH)))
    GPUModelRunner._model_forward(runner, input_ids=None, positions=None)
    assert seen == [["a", "b"]] and reasonformer.BATCH == []  # cleared after the forward
    reasonformer.FINISHED.clear()
    update = GPUModelRunner._update_states
    try:
        GPUModelRunner._update_states(runner, SimpleNamespace(finished_req_ids={"a"}))
    except AttributeError:  # vLLM's own update needs a real runner; the finished ids were taken first
        pass
    assert reasonformer.FINISHED == {"a"}
    assert update is GPUModelRunner._update_states
