"""Multi-LoRA: each adapter's greedy output is transformers + PEFT's, with adapters of
different ranks and the base model mixed in one batch (chunked, prefix-cached, preempted)."""
from __future__ import annotations

import json

import pytest
import torch
from helpers import random_prompts
from safetensors import safe_open
from safetensors.torch import save_file

from baton import LLM, SamplingParams
from baton.engine.common.errors import InUse, InvalidArgument, NotFound

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def mixed(prompts_per_adapter: int, seed: int):
    """Prompts of mixed lengths, each with an adapter (None: the base), interleaved."""
    names = [None, "sql", "chat", "code"]
    prompts = random_prompts([5 + 13 * i for i in range(prompts_per_adapter * len(names))], seed=seed)
    return prompts, [names[i % len(names)] for i in range(len(prompts))]


def assert_matches_peft(peft_ref, adapters, prompts, names, outputs):
    for prompt, name, out in zip(prompts, names, outputs, strict=True):
        want = peft_ref.greedy(adapters[name] if name else None, prompt, GREEDY.max_tokens)
        assert out.token_ids == want, f"adapter {name}, prompt of {len(prompt)} tokens"


# One step per prompt, and chunked prefill; an adapter's rows as ranges (the runner orders rows by
# adapter), and scattered (the reference attention keeps its length order): gathered by index.
@pytest.mark.parametrize("budget,attention", [(2048, "auto"), (24, "auto"), (24, "torch")])
def test_mixed_batch_matches_peft(tiny_llama, adapters, peft_ref, budget, attention):
    llm = LLM(tiny_llama, dtype="float32", device="cpu", lora_modules=adapters, max_loras=3,
              max_num_batched_tokens=budget, attention_backend=attention)
    prompts, names = mixed(2, seed=3)
    outputs = llm.generate(prompts, GREEDY, lora_request=names)
    assert_matches_peft(peft_ref, adapters, prompts, names, outputs)
    # The adapters change the output (else this test could not fail).
    base = [peft_ref.greedy(None, p, GREEDY.max_tokens) for p in prompts]
    assert sum(o.token_ids != b for o, b, n in zip(outputs, base, names) if n) >= 4
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_prefix_cache_is_per_adapter(tiny_llama, adapters, peft_ref):
    llm = LLM(tiny_llama, dtype="float32", device="cpu", lora_modules=adapters, max_loras=2)
    prompt = random_prompts([70], seed=9)[0]
    first = llm.generate([prompt, prompt], GREEDY, lora_request=["sql", None])
    # The same prompt under another adapter finds nothing; under the same adapter, its blocks.
    again = llm.generate([prompt, prompt], GREEDY, lora_request=["sql", "chat"])
    assert again[0].num_cached_tokens == 64 and again[1].num_cached_tokens == 0
    for out, name in zip(first + again, ["sql", None, "sql", "chat"]):
        assert out.token_ids == peft_ref.greedy(adapters[name] if name else None, prompt, GREEDY.max_tokens)
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_max_loras_bounds_each_step(tiny_llama, adapters, peft_ref):
    llm = LLM(tiny_llama, dtype="float32", device="cpu", lora_modules=adapters, max_loras=1,
              max_num_seqs=8)
    steps = []
    runner = llm.engine.runner
    prepare = runner.lora.prepare

    def spy(spans):
        steps.append({adapter for adapter, _, _ in spans} - {0})
        prepare(spans)
    runner.lora.prepare = spy
    prompts, names = mixed(2, seed=4)
    outputs = llm.generate(prompts, GREEDY, lora_request=names)
    assert_matches_peft(peft_ref, adapters, prompts, names, outputs)
    assert max(len(s) for s in steps) == 1 and len(set().union(*steps)) == 3
    assert runner.lora.num_loads >= 3  # one slot: adapters take turns in it
    snapshot = llm.engine.snapshot()  # what GetLoad's figures and /metrics' baton:lora_* come from
    assert ((snapshot.num_loras, snapshot.num_running_loras, snapshot.num_lora_device_loads)
            == (3, 0, runner.lora.num_loads))


def test_preempted_under_a_small_pool(tiny_llama, adapters, peft_ref):
    llm = LLM(tiny_llama, dtype="float32", device="cpu", lora_modules=adapters, max_loras=3,
              num_kv_blocks=24, max_model_len=128)
    prompts, names = mixed(2, seed=5)
    outputs = llm.generate(prompts, GREEDY, lora_request=names)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_matches_peft(peft_ref, adapters, prompts, names, outputs)
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_load_and_unload_at_run_time(tiny_llama, adapters, peft_ref):
    llm = LLM(tiny_llama, dtype="float32", device="cpu", enable_lora=True, max_loras=2)
    prompt = random_prompts([20], seed=6)[0]
    with pytest.raises(NotFound, match="'sql'") as e:
        llm.generate(prompt, GREEDY, lora_request="sql")
    assert e.value.field == "adapter"
    # Loaded while requests run: they go on, and the adapter's requests join them.
    base = llm.engine.add_request("base", prompt, GREEDY)
    llm.engine.step()
    llm.load_adapter("sql", adapters["sql"])
    tuned = llm.engine.add_request("tuned", prompt, GREEDY, adapter="sql")
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert base.output_token_ids == peft_ref.greedy(None, prompt, 12)
    assert tuned.output_token_ids == peft_ref.greedy(adapters["sql"], prompt, 12)
    # In use: refused, and the request carries on.
    llm.engine.add_request("busy", prompt, GREEDY, adapter="sql")
    with pytest.raises(InUse, match="1 request"):
        llm.unload_adapter("sql")
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    llm.unload_adapter("sql")
    with pytest.raises(NotFound):
        llm.generate(prompt, GREEDY, lora_request="sql")
    # A new adapter under the old name is a new adapter: no stale blocks or weights.
    llm.load_adapter("sql", adapters["code"])
    assert (llm.generate(prompt, GREEDY, lora_request="sql")[0].token_ids
            == peft_ref.greedy(adapters["code"], prompt, 12))
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_bad_adapters_are_refused_naming_the_field(tiny_llama, tiny_qwen2, adapters, tmp_path):
    from lora_adapters import write_adapter
    llm = LLM(tiny_llama, dtype="float32", device="cpu", enable_lora=True, max_lora_rank=8)
    with pytest.raises(InvalidArgument, match="rank 16 is above max_lora_rank 8") as e:
        llm.load_adapter("code", adapters["code"])
    assert e.value.field == "r"
    with pytest.raises(InvalidArgument) as e:
        llm.load_adapter("x", str(tmp_path / "missing"))
    assert e.value.field == "lora_path"
    # Trained on another base: of another architecture, or of other shapes.
    other = write_adapter(tiny_qwen2, str(tmp_path / "qwen"), 4, 8, False, ["q_proj", "gate_proj"], seed=7)
    with pytest.raises(InvalidArgument, match="trained on a Qwen2ForCausalLM") as e:
        llm.load_adapter("qwen", other)
    assert e.value.field == "base_model_class"
    config = json.load(open(f"{other}/adapter_config.json"))
    config["auto_mapping"] = None
    json.dump(config, open(f"{other}/adapter_config.json", "w"))
    with safe_open(f"{other}/adapter_model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    key = next(k for k in tensors if "q_proj.lora_A" in k)
    tensors[key] = torch.zeros(4, 32)  # a base of hidden size 32
    save_file(tensors, f"{other}/adapter_model.safetensors")
    with pytest.raises(InvalidArgument, match=r"is \[4, 32\], this model needs \[4, 64\]") as e:
        llm.load_adapter("qwen", other)
    assert e.value.field == "base_model_name_or_path"
    # Target modules the model lacks.
    config["target_modules"] = ["q_proj", "lm_head"]
    json.dump(config, open(f"{other}/adapter_config.json", "w"))
    with pytest.raises(InvalidArgument, match="lm_head") as e:
        llm.load_adapter("qwen", other)
    assert e.value.field == "target_modules"
    assert llm.engine.inputs.loaded_adapters() == []  # nothing half-loaded


@pytest.mark.parametrize("args,field", [({"max_loras": 0}, "max_loras"), ({"max_lora_rank": -1}, "max_lora_rank"),
                                        ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras"),
                                        ({"lora_modules": {"a": "/nonexistent"}}, "lora_modules.a.lora_path")])
def test_bad_engine_arguments(tiny_llama, args, field):
    with pytest.raises(InvalidArgument) as e:
        LLM(tiny_llama, dtype="float32", device="cpu", **args)
    assert e.value.field == field


def test_the_device_room_kept_for_an_adapter_is_what_one_takes(tiny_llama, adapters):
    """On a GPU the KV cache leaves max_loras adapters' room (adapter_bytes): an adapter of
    every projection at the highest rank takes exactly that."""
    from baton.engine.common.config import read_config
    from baton.engine.worker.lora.adapter import adapter_bytes, load_adapter
    from baton.engine.worker.models import model_args

    args = model_args(read_config(tiny_llama))
    _, weights = load_adapter(adapters["code"], args, 16)  # rank 16 on all seven projections
    assert weights.nbytes == adapter_bytes(args, 16, 4)
    _, small = load_adapter(adapters["sql"], args, 16)
    assert small.nbytes < adapter_bytes(args, small.rank, 4)
