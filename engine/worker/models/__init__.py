"""The model families Baton runs, chosen by the `architectures` name in config.json. A family is
a small module that reads its config into ModelArgs (args.py); the layers (basic.py, layers.py,
rope.py, moe.py, mla.py) are shared."""
from __future__ import annotations

from baton.engine.common.errors import InvalidArgument
from baton.engine.worker.models import (
    deepseek,
    gemma2,
    gemma3,
    gemma3_vl,
    gpt_oss,
    llama,
    llava,
    mistral,
    mixtral,
    olmo2,
    phi3,
    qwen2,
    qwen2_5_vl,
    qwen3,
    qwen3_vl,
    qwen_moe,
)
from baton.engine.worker.models.args import ModelArgs
from baton.engine.worker.models.layers import CausalLM

# architecture name -> the function reading its config
FAMILIES = {"DeepseekV2ForCausalLM": deepseek.v2, "DeepseekV3ForCausalLM": deepseek.v3,
            "Gemma2ForCausalLM": gemma2.args, "Gemma3ForCausalLM": gemma3.args,
            "Gemma3ForConditionalGeneration": gemma3_vl.args, "GptOssForCausalLM": gpt_oss.args,
            "LlamaForCausalLM": llama.args, "LlavaForConditionalGeneration": llava.args,
            "LlavaNextForConditionalGeneration": llava.args,
            "MistralForCausalLM": mistral.args, "MixtralForCausalLM": mixtral.args,
            "Olmo2ForCausalLM": olmo2.args, "Phi3ForCausalLM": phi3.args, "Qwen2ForCausalLM": qwen2.args,
            "Qwen2_5_VLForConditionalGeneration": qwen2_5_vl.args, "Qwen2VLForConditionalGeneration": qwen2_5_vl.args,
            "Qwen2MoeForCausalLM": qwen_moe.qwen2_moe, "Qwen3ForCausalLM": qwen3.args,
            "Qwen3MoeForCausalLM": qwen_moe.qwen3_moe, "Qwen3VLForConditionalGeneration": qwen3_vl.args}

__all__ = ["FAMILIES", "CausalLM", "ModelArgs", "model_args"]


def model_args(cfg: dict) -> ModelArgs:
    """The model a config.json describes; InvalidArgument naming the field for what Baton does not run."""
    arch = (cfg.get("architectures") or [""])[0]
    family = FAMILIES.get(arch)
    if family is None:
        raise InvalidArgument("model", f"architecture {arch!r} is not supported (supported: {', '.join(FAMILIES)})")
    return family(cfg)

