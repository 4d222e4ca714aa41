"""Bad engine arguments, sampling parameters and prompts raise errors that name the field."""
from __future__ import annotations

import pytest

from baton import LLM, SamplingParams
from baton.engine.common.errors import InvalidArgument


@pytest.mark.parametrize("kwargs,field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"seed": "x"}, "seed"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
])
def test_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidArgument) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field and str(err.value).startswith(f"{field}: ")


@pytest.mark.parametrize("kwargs,field", [
    ({"block_size": 0}, "block_size"),
    ({"block_size": 12}, "block_size"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_batched_tokens": -1}, "max_num_batched_tokens"),
    ({"scheduling_policy": "lifo"}, "scheduling_policy"),
    ({"dtype": "int8"}, "dtype"),
    ({"device": "tpu"}, "device"),
    ({"num_kv_blocks": 0}, "num_kv_blocks"),
    ({"num_kv_blocks": 2, "max_model_len": 512}, "num_kv_blocks"),
    ({"max_model_len": 10**6}, "max_model_len"),
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 16}, "max_num_batched_tokens"),
    ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
    ({"max_num_seq": 4}, "max_num_seq"),  # a typo is not silently ignored
])
def test_engine_args_name_the_field(tiny_llama, kwargs, field):
    with pytest.raises(InvalidArgument) as err:
        LLM(tiny_llama, device=kwargs.pop("device", "cpu"), **kwargs)
    assert err.value.field == field


def test_model_dir_must_be_a_checkpoint(tmp_path):
    with pytest.raises(InvalidArgument) as err:
        LLM(str(tmp_path / "missing"))
    assert err.value.field == "model"
    with pytest.raises(InvalidArgument, match="config.json"):
        LLM(str(tmp_path))


def test_bad_prompts_fail_alone(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", device="cpu", max_model_len=64)
    engine = llm.engine
    engine.add_request("ok", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    for req_id, prompt, field in [("empty", "", "prompt"), ("no-ids", [], "prompt"),
                                  ("oov", [1, 10**6], "prompt_token_ids"), ("long", [5] * 65, "prompt"),
                                  ("ok", [1], "request_id"), ("", [1], "request_id")]:
        with pytest.raises(InvalidArgument) as err:
            engine.add_request(req_id, prompt, SamplingParams())
        assert err.value.field == field, req_id
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.request_id for o in outputs] == ["ok"] * 4 and outputs[-1].finish_reason == "length"
    assert engine.kv.num_free_blocks == engine.num_kv_blocks
