"""Async scheduling (engine/core/step_loop.py, worker/queued_step.py): step N+1 is scheduled and
queued before step N's tokens are taken, a request's last token read on the device. What it
must keep: every output as one step at a time makes it (greedy equal to transformers, seeded
samples equal to a synchronous engine's), with requests ending at different steps, stop tokens
that end one while its next step is already queued, preemption, and requests that need the host
between steps (logprobs) mixed in; the pool full afterwards."""
from __future__ import annotations

import logging

import pytest
from helpers import random_prompts

from baton import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def counted_ahead(llm: LLM) -> list[bool]:
    """Per queued step, whether the step before was still in flight when it was queued."""
    core, ahead = llm.engine.core, []
    submit = core.runner.submit

    def counted(sched):
        ahead.append(core.step_in_flight and sched.total_num_scheduled_tokens > 0)
        return submit(sched)
    core.runner.submit = counted
    return ahead


def engine(model_dir: str, **extra) -> LLM:
    return LLM(model_dir, **{"dtype": "float32", "device": "cpu", "async_scheduling": True,
                             "max_num_batched_tokens": 48, "max_model_len": 192, **extra})


def test_greedy_outputs_equal_transformers_with_ends_stops_and_preemption(tiny_llama, hf):
    prompts = random_prompts([3, 17, 40, 75, 9, 30], seed=21)
    counts = [12, 5, 9, 3, 7, 11]
    want = [hf.greedy(tiny_llama, p, n) for p, n in zip(prompts, counts)]
    # The fourth token of the second prompt's output stops it (while its next step is queued).
    stop = want[1][3]
    llm = engine(tiny_llama, num_kv_blocks=8, max_model_len=96)
    ahead = counted_ahead(llm)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in counts]
    params[1] = SamplingParams(max_tokens=counts[1], temperature=0.0, ignore_eos=True, stop_token_ids=[stop])
    outs = llm.generate(prompts, params)
    for i, (out, tokens) in enumerate(zip(outs, want)):
        expected = tokens[:tokens.index(stop) + 1] if i == 1 else tokens
        assert out.token_ids == expected, f"prompt {i}"
    assert outs[1].finish_reason == "stop"
    assert sum(ahead) >= 10, ahead  # most steps were queued behind the one before
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks
    assert not llm.engine.core.step_in_flight


def test_seeded_samples_equal_a_synchronous_engine(tiny_llama):
    prompts = random_prompts([5, 23, 11, 60], seed=4)
    params = [SamplingParams(max_tokens=6 + 3 * i, temperature=0.9, top_p=0.95, seed=100 + i) for i in range(4)]
    sync = LLM(tiny_llama, dtype="float32", device="cpu", max_num_batched_tokens=48, max_model_len=192)
    want = [o.token_ids for o in sync.generate(prompts, params)]
    assert [o.token_ids for o in engine(tiny_llama).generate(prompts, params)] == want


def test_requests_that_need_the_host_between_steps_run_one_step_at_a_time(tiny_llama, hf):
    """A request asking for logprobs makes the steps it is in synchronous; the others' outputs do
    not change, and its logprobs are there."""
    prompts = random_prompts([7, 19, 33], seed=8)
    llm = engine(tiny_llama)
    ahead = counted_ahead(llm)
    params = [GREEDY, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2), GREEDY]
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf.greedy(tiny_llama, prompt, 12)
    assert len(outs[1].outputs[0].logprobs) == 12
    assert not any(ahead)  # the logprobs request lived through every step
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_engines_that_cannot_schedule_ahead_say_why(tiny_llama, caplog):
    with caplog.at_level(logging.WARNING, logger="baton.engine.core.engine_builder"):
        llm = engine(tiny_llama, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert "speculative decoding" in caplog.text
    prompts = random_prompts([9, 14], seed=2)
    ahead = counted_ahead(llm)
    llm.generate(prompts, GREEDY)
    assert not any(ahead)


def test_the_flag_reaches_the_engine_and_the_stacks_engines(tiny_llama):
    from baton.services.cli.engine_args import engine_argv, engine_config
    from baton.services.cli.main import build_parser

    args = build_parser().parse_args(["up", "--model", tiny_llama, "--async-scheduling"])
    assert engine_config(args).async_scheduling and "--async-scheduling" in engine_argv(args)
    assert not engine_config(build_parser().parse_args(["serve", "--model", tiny_llama])).async_scheduling


@pytest.mark.parametrize("bad", ["yes", 1])
def test_a_bad_value_is_refused_naming_the_field(tiny_llama, bad):
    from baton.engine.common.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="async_scheduling"):
        LLM(tiny_llama, device="cpu", async_scheduling=bad)


def test_disaggregated_engines_schedule_ahead_and_equal_colocated(tiny_llama):
    """A prefill and a decode engine over real NIXL transfers, both scheduling ahead: the
    connector's loads start and its finished transfers are reported in queued steps (a load that
    ends while a step is queued is seen a step later), and the outputs equal one colocated
    engine's; every block is back and nothing is held."""
    from nixl_engines import assert_pools_full, connect, disaggregated, nixl_engine

    prompts = random_prompts([3, 16, 17, 40, 77], seed=31)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (14, 6, 11, 3, 9)]
    want = [o.token_ids for o in LLM(tiny_llama, dtype="float32", device="cpu").generate(prompts, params)]
    prefill = nixl_engine(tiny_llama, "prefill", async_scheduling=True, max_num_batched_tokens=48)
    decode = nixl_engine(tiny_llama, "decode", async_scheduling=True)
    assert prefill.core.loop.ahead and decode.core.loop.ahead
    connect(prefill, decode)
    ahead = []
    submit = decode.core.runner.submit

    def counted(sched):
        ahead.append(decode.core.step_in_flight and sched.total_num_scheduled_tokens > 0)
        return submit(sched)
    decode.core.runner.submit = counted
    assert disaggregated(prefill, decode, prompts, params) == want
    del decode.core.runner.submit
    assert sum(ahead) >= 5, ahead
    assert decode.runner.connector.num_blocks_pulled > 0
    assert_pools_full(prefill, decode)
    assert not decode.core.step_in_flight and not prefill.core.step_in_flight


def test_the_host_tier_under_async_scheduling(tiny_llama):
    """Swap preemption (a victim's step may still be in flight when the scheduler swaps it out:
    its copy is ordered after that step) and prefix blocks written back and loaded from the host
    tier, with steps queued ahead: the outputs equal a synchronous engine's with the same tier,
    greedy and seeded, and both tiers settle with nothing in flight."""
    from helpers import gib
    from test_host_kv_tier import assert_tiers_settled, conversations

    prompts = random_prompts([100, 60, 90, 30, 75, 45], seed=2)
    params = [GREEDY if i % 2 == 0 else SamplingParams(max_tokens=12, temperature=0.9, seed=7 + i, ignore_eos=True)
              for i in range(len(prompts))]
    turns = [[conv[t] for conv in conversations(4, 2)] for t in range(2)]
    outs = {}
    for ahead in (False, True):
        llm = LLM(tiny_llama, dtype="float32", device="cpu", num_kv_blocks=12, max_model_len=192,
                  kv_offloading_size=gib(64), preemption_mode="swap", async_scheduling=ahead)
        assert llm.engine.core.loop.ahead == ahead
        queued = counted_ahead(llm)
        outs[ahead] = [o.token_ids for o in llm.generate(prompts, params)]
        outs[ahead] += [o.token_ids for prompts_of_turn in turns for o in llm.generate(prompts_of_turn, GREEDY)]
        s = llm.engine.snapshot()
        assert s.num_swap_preemptions > 0 and s.host_kv_cache_hits > 0
        assert sum(queued) >= (10 if ahead else 0), queued
        assert_tiers_settled(llm)
        assert not llm.engine.core.step_in_flight
    assert outs[True] == outs[False]
