"""An FP8 KV cache's scales computed at start (calculate_kv_scales), for a checkpoint that has no
k_scale/v_scale: a built-in calibration text runs once through the model over a throwaway cache
of values (the compute dtype), and each layer's K and V scale per KV head is set from the largest
magnitude it wrote (kernels/kv_quant.calibrated_scales).

At start rather than on the first requests (vLLM's way): the scales are known before the KV
handshake, so a prefill and a decode of one checkpoint compute the same ones and move FP8 blocks
as stored, and a server's scales do not depend on which request came first."""
from __future__ import annotations

import dataclasses

import torch

from baton.engine.common.config import EngineConfig
from baton.engine.common.sampling_params import SamplingParams
from baton.engine.common.scheduler_output import NewRequestData, SchedulerOutput
from baton.engine.common.tokenizer import load_tokenizer
from baton.engine.worker.models import CausalLM
from baton.kernels.kv_quant import calibrated_scales, is_fp8

CALIBRATION_TEXT = (
    "The history of science is the study of how people came to understand the natural world. In 1687 Isaac Newton "
    "published his laws of motion; two centuries later, Maxwell's equations joined electricity and magnetism.\n\n"
    "def mean(values: list[float]) -> float:\n    \"\"\"The arithmetic mean of a non-empty list.\"\"\"\n"
    "    return sum(values) / len(values)\n\n"
    "Q: What is the capital of Japan? A: Tokyo, a city of about 14 million people, 37 million in its metropolitan "
    "area. Prices rose 3.2% in 2023; the bank held its rate at 0.1%.\n"
    "| name | age |\n|---|---|\n| Ada | 36 |\n| Alan | 41 |\n"
    "Bonjour, comment allez-vous ? Muy bien, gracias. 你好，世界。Привет, мир! 12 + 30 = 42, and 7 × 6 = 42 too."
)
MAX_CALIBRATION_TOKENS = 256


def model_kv_scales(model: CausalLM) -> torch.Tensor:
    """Every attention layer's scales [layers, 2, kv heads] (float32, on the host)."""
    return torch.stack([layer.self_attn.kv_scales.float().cpu() for layer in model.layers])


def calculate_kv_scales(model: CausalLM, config: EngineConfig) -> None:
    """Where calculate_kv_scales asks for them, the cache is FP8 and the checkpoint has none:
    every layer's scales from CALIBRATION_TEXT (the model's kv_scales_source then "calculated")."""
    dtype = config.kv_torch_dtype(model.embed_tokens.weight.dtype)
    if config.calculate_kv_scales and is_fp8(dtype) and model.kv_scales_source == "default":
        calibrate_kv_scales(model, config, load_tokenizer(config.model).encode(CALIBRATION_TEXT))
        model.kv_scales_source = "calculated"


def calibrate_kv_scales(model: CausalLM, config: EngineConfig, token_ids: list[int]) -> None:
    """Set every attention layer's kv_scales from the K and V `token_ids` (at most
    MAX_CALIBRATION_TOKENS of them) write, computed over a throwaway cache of values."""
    from baton.engine.worker.model_runner import ModelRunner  # (which imports this module's neighbours)

    dtype = config.kv_torch_dtype(model.embed_tokens.weight.dtype)
    if not is_fp8(dtype):
        raise ValueError(f"kv_cache_dtype: scales are for an FP8 cache, not {dtype}")
    ids = token_ids[:min(MAX_CALIBRATION_TOKENS, config.max_model_len - 1)]
    plain = dataclasses.replace(config, kv_cache_dtype="auto", speculative_config=None, accept_kv_from=[])
    blocks = -(-len(ids) // config.block_size)
    runner = ModelRunner(model, plain, blocks, frozenset())
    sched = SchedulerOutput()
    sched.scheduled_new_reqs.append(NewRequestData("kv-calibration", ids, [list(range(blocks))], 0,
                                                   SamplingParams(max_tokens=1, temperature=0.0), len(ids)))
    sched.num_scheduled_tokens["kv-calibration"] = sched.total_num_scheduled_tokens = len(ids)
    runner.execute_model(sched)
    cache = runner.kv_cache  # [blocks, layers, parts, block_size, kv heads, D]: one group of every layer
    tokens = cache.permute(1, 2, 0, 3, 4, 5).flatten(2, 3)[:, :, :len(ids)]  # [layers, parts, tokens, heads, D]
    with torch.no_grad():
        for layer, written in zip(model.layers, tokens, strict=True):
            scales = layer.self_attn.kv_scales
            for part in range(scales.shape[0]):  # MLA caches one part: its one scale serves K and V
                scales[part].copy_(calibrated_scales(written[min(part, written.shape[0] - 1)], dtype))
    runner.close()
