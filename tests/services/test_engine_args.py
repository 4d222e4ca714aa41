"""The engine flags of `baton serve`, `baton up` and `baton generate`: one per EngineConfig field,
each leaving its field to the config's default when not given (the help shows that default),
and the flags `baton up` passes its engines make the same config again."""
from __future__ import annotations

import pytest

from baton.engine.common.config import EngineConfig
from baton.services.cli.engine_args import FLAGS, config_argv, engine_argv, engine_config, engine_kwargs
from baton.services.cli.main import build_parser
from baton.services.cli.tls_flags import tls_config

ENGINE_COMMANDS = ("serve", "up", "generate")

# A value other than the default for every field: what a command line given all of them makes.
GIVEN = {"device": "cpu", "dtype": "float32", "max_num_seqs": 8, "max_num_batched_tokens": 512, "max_model_len": 256,
         "block_size": 32, "num_kv_blocks": 100, "kv_cache_memory_bytes": 1 << 20, "gpu_memory_utilization": 0.5,
         "attention_backend": "torch", "long_prefill_token_threshold": 64, "scheduling_policy": "priority",
         "kv_offloading_size": 0.01, "preemption_mode": "swap", "tensor_parallel_size": 2, "seed": 7, "max_loras": 2,
         "max_lora_rank": 8, "max_cpu_loras": 3, "enable_prefix_caching": False, "enable_chunked_prefill": False,
         "enable_lora": True, "disable_hybrid_kv_cache_manager": True, "enable_expert_parallel": True,
         "enforce_eager": True, "async_scheduling": True, "cudagraph_capture_sizes": [1, 4, 16],
         "lora_modules": {"sql": "/adapters/sql", "odd": "/a=b"},
         "speculative_config": {"method": "ngram", "num_speculative_tokens": 4},
         "accept_kv_from": ["0123456789abcdef0123456789abcdef"], "kv_cache_dtype": "fp8", "calculate_kv_scales": True,
         "max_num_encoder_input_tokens": 1024, "encoder_cache_size": 2048}


def test_every_config_field_has_one_flag():
    fields = [f.field for f in FLAGS]
    assert sorted(fields) == sorted(EngineConfig.defaults()) == sorted(GIVEN)
    assert len({f.flag for f in FLAGS}) == len(FLAGS)


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_flags_left_out_leave_the_config_its_defaults(command, tiny_llama):
    args = build_parser().parse_args([command, "--model", tiny_llama])
    assert all(vars(args)[f.field] is None for f in FLAGS)  # every one registered, none given
    assert engine_kwargs(args) == {} and engine_argv(args) == []
    assert engine_config(args) == EngineConfig(model=tiny_llama)


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_help_shows_the_configs_defaults(command):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    helps = {a.dest: a.help for a in sub._actions}
    defaults = EngineConfig.defaults()
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "gpu_memory_utilization", "max_loras",
                 "preemption_mode", "tensor_parallel_size", "device"):
        assert helps[name].endswith(f"(default: {defaults[name]})"), (name, helps[name])
    assert helps["max_model_len"].endswith("(default: the model's, capped at 8192)")


def test_every_flag_makes_its_field_and_goes_to_the_engines_as_given(tiny_llama):
    argv = config_argv(GIVEN)
    args = build_parser().parse_args(["up", "--model", tiny_llama, *argv])
    assert engine_kwargs(args) == GIVEN
    # What `baton up` passes its engines, less each tier's own tensor parallel size, parses back to the same.
    passed = engine_argv(args, leave_out=("tensor_parallel_size",))
    engine = build_parser().parse_args(["serve", "--model", tiny_llama, *passed])
    assert engine_kwargs(engine) == {k: v for k, v in GIVEN.items() if k != "tensor_parallel_size"}
    assert "--no-prefix-caching" in passed and "--enable-lora" in passed and "--tensor-parallel-size=2" not in passed


def test_a_switch_at_its_default_and_an_unknown_field_are_not_flags():
    assert config_argv({"enable_prefix_caching": True, "enforce_eager": False}) == []
    with pytest.raises(ValueError, match="^model: no engine flag sets it"):
        config_argv({"model": "/m"})


@pytest.mark.parametrize("flags,message", [
    (("--lora-modules", "nopath"), "baton serve: --lora-modules: expected NAME=PATH, got 'nopath'"),
    (("--speculative-config", "{ngram"), "baton serve: --speculative-config: not JSON"),
])
def test_a_malformed_flag_exits_naming_it(tiny_llama, flags, message):
    with pytest.raises(SystemExit, match=f"^{message}"):
        engine_config(build_parser().parse_args(["serve", "--model", tiny_llama, *flags]))


def test_generate_seed_seeds_the_engine_and_the_requests(tiny_llama):
    args = build_parser().parse_args(["generate", "--model", tiny_llama, "--seed", "5"])
    assert args.seed == 5 and engine_config(args).seed == 5
    assert build_parser().parse_args(["generate", "--model", tiny_llama]).seed is None


@pytest.mark.parametrize("command", ["serve", "generate", "check-stack", "health"])
def test_tls_flags_left_out_are_plaintext(command):
    target = [] if command in ("serve", "generate") else ["--target", "h:1"]
    assert tls_config(build_parser().parse_args([command, *target])) is None
    with pytest.raises(ValueError, match="^tls_cert_file and tls_key_file: give both or neither"):
        tls_config(build_parser().parse_args([command, *target, "--tls-cert-file", __file__]))
