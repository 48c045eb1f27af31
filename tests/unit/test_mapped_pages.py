"""Pages of a mapped checkpoint that no weight uses are given back after loading; the weights in use are untouched."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from chorus.engines.transformers.mapped_pages import release_unused, safetensors_mappings, unused_pages

PAGE = 4096


def test_unused_pages_are_whole_pages_outside_every_used_range() -> None:
    lo, hi = 0, 10 * PAGE
    used = [(PAGE + 100, 2 * PAGE + 10), (5 * PAGE, 6 * PAGE)]
    # [0, PAGE) free; page 1 and 2 partly used (kept); pages 3-4 free; page 5 used; pages 6-9 free
    assert unused_pages(lo, hi, used, PAGE) == [(0, PAGE), (3 * PAGE, 5 * PAGE), (6 * PAGE, 10 * PAGE)]
    assert unused_pages(lo, hi, [(0, hi)], PAGE) == []
    assert unused_pages(lo, hi, [], PAGE) == [(0, hi)]


def resident_kb(path: Path) -> int:
    """Resident kB of this process's mappings of ``path``."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc: Linux")
def test_an_moe_gives_back_its_experts_file_pages_and_answers_the_same(tmp_path: Path) -> None:
    """A Mixtral checkpoint: transformers keeps the attention and embedding weights in the file's mapping and
    fuses each layer's experts into new tensors, reading the experts' pages once; those pages are given back,
    the ones in use stay, and the model answers exactly as before."""
    from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=1024, hidden_size=128, intermediate_size=2048, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
                        max_position_embeddings=64)
    torch.manual_seed(0)
    MixtralForCausalLM(cfg).save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 42]])
    with torch.inference_mode():
        before = model(ids).logits
    held = resident_kb(file)
    if not held:
        pytest.skip("transformers did not keep the file mapped here")
    released = release_unused(model)
    experts = 2 * 8 * 3 * 128 * 2048 * 4  # layers x experts x (w1, w2, w3) x float32
    assert released > 0.9 * experts
    assert resident_kb(file) < held - 0.9 * experts / 1024
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, before)
    assert any(str(file) == p for _, _, p in safetensors_mappings())  # (the weights in use: still mapped)
