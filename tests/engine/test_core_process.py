"""The engine core in a process of its own, seen from its front (CoreClient): outputs a slow
reader left queued are merged, never lost or reordered; ids reused at once get runs of their
own; a core that dies fails its streams at once; a front that dies takes its core with it;
a call the core cannot answer is its caller's error; the front loads neither torch nor NIXL."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from typing import ClassVar

import msgspec
import pytest
from helpers import alive, random_prompts, stats

from baton import LLM
from baton.engine.common.config import EngineConfig
from baton.engine.common.core_messages import (
    CoreCallFailed,
    CoreMessage,
    CoreOutput,
    CoreStep,
    GetSnapshot,
    LoadAdapter,
    ReleaseHold,
)
from baton.engine.common.errors import InvalidArgument
from baton.engine.common.sampling_params import SamplingParams
from baton.engine.front.core_client import CoreClient, EngineDead, _Stream, merge_queued
from baton.engine.front.output_processor import StepOutput
from baton.services.client import Client


def step(tokens, text, finished=False):
    return StepOutput("r", tokens, text, finished, "length" if finished else None, 3, 0, 0)


def test_queued_outputs_merge_up_to_the_last():
    async def run():
        queue = asyncio.Queue()
        for out in (step([2], "b"), step([3, 4], "cd", finished=True)):
            queue.put_nowait(out)
        return merge_queued(step([1], "a"), queue), queue.empty()

    merged, drained = asyncio.run(run())
    assert ((merged.new_token_ids, merged.text, merged.finished, merged.finish_reason)
            == ([1, 2, 3, 4], "abcd", True, "length"))
    assert drained


def test_under_a_stream_interval_the_first_output_goes_at_once_then_only_enough_tokens_or_the_last():
    async def run():
        stream, sizes = _Stream(), []
        for out in (step([1], "a"), step([2], "b"), step([3, 4], "cd"), step([5], "e"), step([6], "f"),
                    step([7], "g"), step([8], "h", finished=True)):
            stream.put(out, 4)
            while not stream.queue.empty():
                sizes.append(stream.queue.get_nowait().new_token_ids)
        return sizes

    assert asyncio.run(run()) == [[1], [2, 3, 4, 5], [6, 7, 8]]


def test_logprobs_queued_before_a_last_output_without_them_are_kept():
    async def run():
        queue = asyncio.Queue()
        queue.put_nowait(step([], "", finished=True))  # an abort's last output carries no logprobs
        first = step([1], "a")
        first.logprobs = ["lp1"]
        return merge_queued(first, queue)

    assert asyncio.run(run()).logprobs == ["lp1"]


def test_an_error_queued_behind_outputs_is_raised():
    async def run():
        queue = asyncio.Queue()
        queue.put_nowait(EngineDead("boom"))
        return merge_queued(step([1], "a"), queue)

    with pytest.raises(EngineDead):
        asyncio.run(run())


def test_a_step_s_plain_tokens_go_as_columns_and_each_request_s_outputs_stay_in_order():
    """Two pipelined steps in one message: a request whose first token (ready_time) is in it
    sends its next one as an output too, after it; the others' lone tokens go as columns."""
    outputs = [CoreOutput(1, [11]), CoreOutput(2, [21], ready_time=5.0, num_cached_tokens=16),
               CoreOutput(3, [31], logprobs=[]), CoreOutput(4, [41, 42]), CoreOutput(5, [51], finish_reason="length"),
               CoreOutput(1, [12]), CoreOutput(2, [22]), CoreOutput(6, [61], num_cached_tokens=16)]
    msg = msgspec.msgpack.Decoder(CoreMessage).decode(msgspec.msgpack.encode(CoreStep(outputs, 1.0, 0, 3).to_columns()))
    assert [(o.key, o.new_token_ids) for o in msg.outputs] == [(2, [21]), (3, [31]), (4, [41, 42]), (5, [51]),
                                                               (2, [22])]
    assert (msg.token_keys, msg.token_ids) == ([1, 1, 6], [11, 12, 61])
    assert CoreStep([CoreOutput(1, [11])], 1.0, 0, 0).to_columns().outputs == []


def _client(model_dir: str, **kwargs) -> CoreClient:
    config = EngineConfig.from_kwargs(model_dir, dtype="float32", device="cpu")
    return CoreClient(config, f"test-{os.getpid()}-{time.monotonic_ns()}", 30.0, **kwargs)



def test_an_id_reused_right_after_its_stream_left_gets_a_run_of_its_own(tiny_llama):
    """A client that cancels and retries at once with the same request id: the retry never
    receives the old request's outputs, and the core runs it whole."""
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0)

    async def run():
        core = _client(tiny_llama)
        await core.start()
        try:
            results = []
            for _ in range(5):
                first = core.generate(core.inputs.core_request("x", [5, 6, 7, 8], params))
                await anext(first)
                await anext(first)
                await first.aclose()  # the client leaves: the abort is on its way
                outs = [o async for o in core.generate(core.inputs.core_request("x", [5, 6, 7, 8], params))]
                results.append((outs[-1].finish_reason, sum(len(o.new_token_ids) for o in outs)))
            snapshot = await core.call(GetSnapshot())
            return results, snapshot
        finally:
            await core.stop()

    results, snapshot = asyncio.run(asyncio.wait_for(run(), 120))
    assert results == [("length", 40)] * 5
    assert snapshot.num_free_kv_blocks == snapshot.num_kv_blocks


def test_a_call_whose_caller_left_still_runs_and_the_core_goes_on(tiny_llama):
    async def run():
        core = _client(tiny_llama)
        await core.start()
        try:
            os.kill(core.pid, signal.SIGSTOP)  # the core holds (a long step)
            left = asyncio.ensure_future(core.call(ReleaseHold("nobody")))
            await asyncio.sleep(0.05)
            left.cancel()  # its caller goes away before the core reaches it
            os.kill(core.pid, signal.SIGCONT)
            return await asyncio.wait_for(core.call(GetSnapshot()), 10)
        finally:
            await core.stop()

    assert asyncio.run(run()).num_running == 0


class NoSuchCall(msgspec.Struct, tag=True, array_like=True):
    """A call this core does not know (as from a front of another version)."""
    result: ClassVar = int


def test_an_unknown_or_failing_call_is_its_caller_s_error_and_the_core_serves_on(tiny_llama):
    async def run():
        core = _client(tiny_llama)
        await core.start()
        try:
            with pytest.raises(CoreCallFailed, match="NoSuchCall"):
                await asyncio.wait_for(core.call(NoSuchCall()), 10)
            with pytest.raises(InvalidArgument, match="LoRA is not enabled"):  # a known call that fails
                await asyncio.wait_for(core.call(LoadAdapter("a", "/nowhere")), 10)
            params = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0)
            outs = [o async for o in core.generate(core.inputs.core_request("after", [5, 6, 7], params))]
            return outs, await core.call(GetSnapshot())
        finally:
            await core.stop()

    outs, snapshot = asyncio.run(asyncio.wait_for(run(), 60))
    assert outs[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in outs) == 5
    assert snapshot.num_free_kv_blocks == snapshot.num_kv_blocks


def test_a_killed_core_fails_its_streams_and_calls_at_once(tiny_llama):
    deaths = []

    async def run():
        core = _client(tiny_llama, on_dead=deaths.append)
        await core.start()
        params = SamplingParams(max_tokens=1000, ignore_eos=True, temperature=0.0)
        streams = [core.generate(core.inputs.core_request(f"r{i}", [5, 6, 7 + i], params)) for i in range(8)]
        for s in streams:
            await anext(s)
        os.kill(core.pid, signal.SIGKILL)
        t0 = time.monotonic()
        errors = []
        for s in streams:
            with pytest.raises(EngineDead) as err:
                async for _ in s:
                    pass
            errors.append(str(err.value))
        waited = time.monotonic() - t0
        with pytest.raises(EngineDead):
            await core.call(GetSnapshot())
        pid = core.pid
        await core.stop()
        return errors, waited, pid

    errors, waited, pid = asyncio.run(asyncio.wait_for(run(), 60))
    assert waited < 2.0 and all("exited with status -9" in e for e in errors), (waited, errors)
    assert len(deaths) == 1 and not alive(pid)


def test_a_core_that_cannot_start_says_why_in_one_sentence(tiny_llama):
    async def run():
        config = EngineConfig.from_kwargs(tiny_llama, dtype="float32", device="cpu", num_kv_blocks=2)
        core = CoreClient(config, "cannot-start", 30.0)
        try:
            await core.start()
        finally:
            await core.stop()

    from baton.engine.common.errors import InvalidArgument
    with pytest.raises(InvalidArgument) as err:
        asyncio.run(run())
    assert err.value.field == "num_kv_blocks" and "max_model_len" in str(err.value)


def leftovers(front_pid: int) -> list[str]:
    """What a front and its core could leave behind: their IPC sockets (abstract names, in
    /proc/net/unix while a process holds them) and files in /dev/shm."""
    with open("/proc/net/unix") as f:
        sockets = [line.split()[-1] for line in f if f"baton-core-{front_pid}-" in line]
    return sockets + os.listdir("/dev/shm")


def test_a_killed_front_takes_its_core_with_it(spawn, tiny_llama):
    shm = set(os.listdir("/dev/shm"))
    server = spawn(tiny_llama)
    address = server.address
    core = stats(address).engine_core_pid
    assert core and core != server.proc.pid and alive(core)
    assert leftovers(server.proc.pid)  # the sockets are there while it runs
    server.proc.kill()
    server.proc.wait(10)
    deadline = time.monotonic() + 5  # (its last threads close its sockets after its main thread exited)
    while (alive(core) or set(leftovers(server.proc.pid)) - shm) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(core)
    assert set(leftovers(server.proc.pid)) <= shm


def test_a_killed_core_ends_the_server_non_zero_with_its_streams_unavailable(spawn, tiny_llama):
    import grpc

    from baton.services.client import Client

    server = spawn(tiny_llama)
    address = server.address
    with Client(address) as client:
        stream = client.generate([5, 6, 7], max_tokens=1000, temperature=0, ignore_eos=True)
        next(stream)
        os.kill(stats(address).engine_core_pid, signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as err:
            for _ in stream:
                pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "engine core exited" in err.value.details()
    assert server.proc.wait(10) == 1
    assert "the engine core died" in "".join(server.lines)
    assert not [name for name in leftovers(server.proc.pid) if "baton" in name]


def test_the_front_imports_neither_torch_nor_nixl_nor_the_core():
    code = ("import sys; import baton.services.server.server, baton.services.router.router, "
            "baton.services.openai.front; import baton.engine.front.core_client; "
            "print(' '.join(m for m in sys.modules if m.split('.')[0] in ('torch', 'nixl') or m.startswith("
            "('baton.engine.core', 'baton.engine.worker', 'baton.kv_transfer.nixl', 'baton.kernels'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.split() == [], done.stdout + done.stderr


def test_a_serving_front_has_not_loaded_torch_or_nixl(spawn, tiny_llama):
    """A running server's front process, having served a request: no torch or NIXL library is
    mapped in it (its engine core, another process, has both)."""
    server = spawn(tiny_llama)
    with Client(server.address) as client:
        assert len([c for c in client.generate([5, 6, 7], max_tokens=3, temperature=0, ignore_eos=True)]) >= 1
    core_pid = stats(server.address).engine_core_pid

    def mapped(pid: int) -> set[str]:
        with open(f"/proc/{pid}/maps") as f:
            return {line.split()[-1] for line in f if "/" in line}
    libraries = {os.path.basename(p) for p in mapped(server.proc.pid)}
    assert not [lib for lib in libraries if "torch" in lib or "nixl" in lib], sorted(libraries)
    core_libraries = mapped(core_pid)
    assert any("libtorch" in p for p in core_libraries) and any("nixl" in p for p in core_libraries)


def test_plain_tokens_reach_a_sink_as_text_and_a_stop_string_in_one_ends_the_request_as_offline(tiny_llama):
    """A stream given a sink gets its plain tokens and their text one by one (on_token); a stop
    string that a plain token completes ends the request with the offline engine's text, and
    its last output still says how much of the prompt was cached."""
    prompt = random_prompts([40], seed=77)[0]
    greedy = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    ids = llm.generate([prompt], SamplingParams(**greedy))[0].token_ids
    texts = [llm.tokenizer.decode(ids[:k]) for k in range(len(ids) + 1)]
    stop = next(piece for k in range(16, len(ids)) if (piece := texts[k][len(texts[k - 1]):]).strip()
                and "\ufffd" not in piece and texts[k].startswith(texts[k - 1])
                and texts[k].find(piece) == len(texts[k - 1]))  # a token's own text, seen first there
    params = SamplingParams(**greedy, stop=[stop])
    want = llm.generate([prompt], params)[0]
    assert want.finish_reason == "stop" and len(want.token_ids) >= 16

    async def run():
        core = _client(tiny_llama)
        await core.start()
        try:
            runs = []
            for name in ("cold", "cached"):  # the second finds the first's prompt blocks
                request = core.inputs.core_request(name, prompt, params)
                outputs, tokens = [], []
                stream = core.generate(request)
                outputs.append(await anext(stream))
                os.kill(core.pid, signal.SIGSTOP)  # (its stop string is many steps away: it stays there)
                try:
                    while not core.sink(request, outputs.append,
                                        lambda token_id, text, into=tokens: into.append((token_id, text))):
                        outputs.append(await anext(stream))  # (what was queued meanwhile first)
                finally:
                    os.kill(core.pid, signal.SIGCONT)
                outputs += [o async for o in stream]
                runs.append({"outputs": outputs, "tokens": tokens})
            return runs, await core.call(GetSnapshot())
        finally:
            await core.stop()

    runs, snapshot = asyncio.run(asyncio.wait_for(run(), 60))
    for got in runs:
        *before, last = got["outputs"]  # (those the loop yielded and any the sink took)
        assert got["tokens"] and all(not o.finished for o in before)
        assert [t for o in before for t in o.new_token_ids] + [t for t, _ in got["tokens"]] + last.new_token_ids \
            == want.token_ids
        assert "".join(o.text for o in before) + "".join(text for _, text in got["tokens"]) + last.text == want.text
        assert (last.finished, last.finish_reason, last.stop_reason) == (True, "stop", stop)
    assert runs[0]["outputs"][-1].num_cached_tokens == 0
    assert runs[1]["outputs"][-1].num_cached_tokens == runs[1]["outputs"][0].num_cached_tokens > 0
    assert snapshot.num_free_kv_blocks == snapshot.num_kv_blocks
