"""chorus's model families on vLLM: an out-of-tree model plugin (vLLM's ``vllm.general_plugins`` entry point,
registered when chorus is installed in vLLM's environment: ``pip install --no-deps chorus-gateway`` there, as
``make vllm`` does for vLLM's CPU build; the plugin needs only what vLLM brings).

MoE (every layout chorus writes) and SOLAR-style grafted checkpoints are standard hub architectures that vLLM
serves natively. MoDr (``model_type: chorus_modr``) and ReasonFormer (``chorus_reasonformer``) are chorus's own:
`register` teaches vLLM both: their configs (``configs``: a Llama config of the base plus the family's settings)
and their model classes (``modr``, ``reasonformer``), which run chorus's forward on vLLM's layers, paged KV cache
and batching (``over_base``: what both share). ``greedy`` is the offline check the tests and the family bench run.

This package is imported by vLLM only (never by chorus's own engines): it needs ``vllm``.
"""

from __future__ import annotations

ARCHITECTURES = {
    "MoDrModel": "chorus.engines.families.on_vllm.modr:MoDrForCausalLM",
    "ReasonFormerModel": "chorus.engines.families.on_vllm.reasonformer:ReasonFormerForCausalLM",
}


def register() -> None:
    """vLLM's plugin hook (run in every vLLM process before a model loads): the configs and the model classes."""
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from chorus.engines.families.on_vllm.configs import CONFIGS

    for model_type, cls in CONFIGS.items():
        try:
            AutoConfig.register(model_type, cls)
        except ValueError:  # registered already (the hook runs once per process, but be safe)
            pass
    for arch, where in ARCHITECTURES.items():
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, where)
