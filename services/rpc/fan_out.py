"""n completions of one request: n child requests (ids `{id}-{i}`, seed + i, the prompt's
logprobs asked by the first only), run concurrently and streamed interleaved, each response
tagged with its completion's index. The engine server and the router both fan out so; the
offline API does the same with SamplingParams.child. Torch-free (the router uses it)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from baton.engine.common.errors import check
from baton.engine.common.sampling_params import MAX_N, child_seed
from baton.v1 import generate_pb2 as pb

_DONE = object()


def num_completions(msg: pb.GenerateRequest) -> int:
    n = msg.sampling.n if msg.sampling.HasField("n") else 1
    check(1 <= n <= MAX_N, "sampling.n", f"must be in [1, {MAX_N}], got {n}")
    return n


def child_requests(msg: pb.GenerateRequest, n: int) -> list[pb.GenerateRequest]:
    children = []
    for i in range(n):
        child = pb.GenerateRequest()
        child.CopyFrom(msg)
        child.request_id = f"{msg.request_id}-{i}"
        child.sampling.ClearField("n")
        if msg.sampling.HasField("seed"):
            child.sampling.seed = child_seed(msg.sampling.seed, i)
        if i:
            child.sampling.ClearField("prompt_logprobs")
        children.append(child)
    return children


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def retag(response: bytes, request_id: str, index: int) -> bytes:
    """A child's serialized GenerateResponse as the parent's: its request_id and index set
    without parsing it (protobuf merges fields appended to a message's bytes, the last of a
    scalar winning): field 1 (string) and field 6 (varint)."""
    rid = request_id.encode()
    return response + bytes([1 << 3 | 2]) + _varint(len(rid)) + rid + bytes([6 << 3]) + _varint(index)


async def merge(streams: list[AsyncIterator]) -> AsyncIterator:
    """Items of all streams as they come; the first error ends everything (the rest are
    cancelled, which aborts their requests)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                queue.put_nowait(item)
        except BaseException as e:  # noqa: BLE001 - handed to the merged stream's reader
            queue.put_nowait(e)
        else:
            queue.put_nowait(_DONE)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
