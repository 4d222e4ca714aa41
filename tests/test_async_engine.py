"""The step-loop bridge: outputs a slow reader left queued are merged, never lost or reordered."""
from __future__ import annotations

import asyncio

import pytest

from baton.engine.llm_engine import StepOutput
from baton.engine.async_engine import EngineDead, _merge_queued


def step(tokens, text, finished=False):
    return StepOutput("r", tokens, text, finished, "length" if finished else None, 3, 0, 0)


def test_queued_outputs_merge_up_to_the_last():
    async def run():
        queue = asyncio.Queue()
        for out in (step([2], "b"), step([3, 4], "cd", finished=True)):
            queue.put_nowait(out)
        return _merge_queued(step([1], "a"), queue), queue.empty()

    merged, drained = asyncio.run(run())
    assert (merged.new_token_ids, merged.text, merged.finished, merged.finish_reason) == ([1, 2, 3, 4], "abcd", True, "length")
    assert drained


def test_logprobs_queued_before_a_last_output_without_them_are_kept():
    async def run():
        queue = asyncio.Queue()
        queue.put_nowait(step([], "", finished=True))  # an abort's last output carries no logprobs
        first = step([1], "a")
        first.logprobs = ["lp1"]
        return _merge_queued(first, queue)

    assert asyncio.run(run()).logprobs == ["lp1"]


def test_an_error_queued_behind_outputs_is_raised():
    async def run():
        queue = asyncio.Queue()
        queue.put_nowait(EngineDead("boom"))
        return _merge_queued(step([1], "a"), queue)

    with pytest.raises(EngineDead):
        asyncio.run(run())


def test_a_call_whose_caller_left_still_runs_and_the_loop_goes_on(tiny_llama):
    import threading

    from baton import LLM
    from baton.engine.async_engine import AsyncEngine

    engine = LLM(tiny_llama, dtype="float32", device="cpu").engine
    gate, ran = threading.Event(), []

    async def run():
        loop = AsyncEngine(engine)
        loop.start()
        try:
            blocker = asyncio.ensure_future(loop.call(gate.wait, 10))  # holds the step-loop thread
            left = asyncio.ensure_future(loop.call(ran.append, "release"))
            await asyncio.sleep(0.05)
            left.cancel()  # its caller goes away before the loop reaches it
            gate.set()
            await blocker
            return await asyncio.wait_for(loop.call(lambda: "alive"), 10)
        finally:
            await loop.stop()

    assert asyncio.run(run()) == "alive"
    assert ran == ["release"]


def test_an_id_reused_right_after_its_stream_left_gets_a_run_of_its_own(tiny_llama):
    """A client that cancels and retries at once with the same request id: the retry waits
    for the old request's abort, and never receives the old request's outputs."""
    from baton import LLM, SamplingParams
    from baton.engine.async_engine import AsyncEngine

    engine = LLM(tiny_llama, dtype="float32", device="cpu").engine
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0)

    async def run():
        loop = AsyncEngine(engine)
        loop.start()
        try:
            results = []
            for _ in range(5):
                first = loop.generate(engine.make_request("x", [5, 6, 7, 8], params))
                await anext(first)
                await anext(first)
                await first.aclose()  # the client leaves: the abort is only queued
                outs = [o async for o in loop.generate(engine.make_request("x", [5, 6, 7, 8], params))]
                results.append((outs[-1].finish_reason, sum(len(o.new_token_ids) for o in outs)))
            return results
        finally:
            await loop.stop()

    assert asyncio.run(asyncio.wait_for(run(), 120)) == [("length", 40)] * 5
    assert engine.kv.num_free_blocks == engine.num_kv_blocks
