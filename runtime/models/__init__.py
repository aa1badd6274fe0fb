"""Our model implementations, looked up by the `architectures` name in a HF config."""

from __future__ import annotations

from .gemma import GemmaForCausalLM
from .llama import LlamaForCausalLM
from .moe import MoEForCausalLM
from .phi3 import Phi3ForCausalLM

MODEL_REGISTRY = {
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MoEForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": MoEForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": MoEForCausalLM,
}


def get_model_class(config) -> type:
    """The model class for a HF config; a ValueError naming the supported ones otherwise (also for
    a checkpoint quantized in a format plait does not load)."""
    from ..model_executor.quantized_checkpoint import checkpoint_quantization

    checkpoint_quantization(config)
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(
        f"unsupported model architecture {archs or getattr(config, 'model_type', '?')}; "
        f"supported: {', '.join(sorted(MODEL_REGISTRY))}"
    )
