"""The host KV tier's memory and copies, next to the device's KV cache tensor (the worker side
of host_kv_tier.py, called by the model runner; the scheduler never touches tensors).

The host pool is a tensor shaped like the device's cache, [num_blocks, layers, 2, block_size,
kv_heads, head_dim]: one block is one contiguous region on both sides, and a run of consecutive
block ids one copy. On a GPU it is pinned, so copies are DMA and asynchronous.

When copies run:
- swap-outs and swap-ins, before the step's forward: the scheduler hands a victim's device blocks
  out again in this very step, and runs a swapped-in request in it. On a GPU they go on the
  compute stream (ordered before the forward, the CPU does not wait); on CPU they run on the
  step thread.
- write-backs and loads, off the step loop, reported done on a later step (`poll`), like the KV
  connector's finished_recving. Their device blocks are pinned (write-back) or owned by a
  request that is not scheduled (load), so the forward never races them. On a GPU they go on a
  side stream that first waits for the compute stream (the KV it copies is written there), and
  an event marks each job. On CPU they go to one background thread, in order: torch releases
  the GIL while it copies, so the copy overlaps the forward pass. Measured on the 2-core dev box
  (bench/multiturn.py --measure-copies --model models/smollm2-135m-instruct, float32 blocks of
  0.70 MiB): a 64-block write-back costs the step loop 6.6 ms inline, 0.08 ms handed to the thread.
"""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

from baton.engine.common.scheduler_output import HostKVOps


def block_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(source start, destination start, length) for runs of pairs consecutive on both sides."""
    runs: list[list[int]] = []
    for s, d in pairs:
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    for s, d, n in block_runs(pairs):
        dst[d:d + n].copy_(src[s:s + n], non_blocking=True)


class HostKVCopier:
    def __init__(self, kv_cache: torch.Tensor, num_blocks: int):
        self.device_cache = kv_cache
        self.on_gpu = kv_cache.device.type == "cuda"
        self.host_cache = torch.empty((num_blocks, *kv_cache.shape[1:]), dtype=kv_cache.dtype, pin_memory=self.on_gpu)
        self._in_flight: deque[tuple[int, object]] = deque()  # (job id, its cuda Event or Future), in order
        if self.on_gpu:
            self._stream = torch.cuda.Stream(kv_cache.device)
        else:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="host-kv")

    def submit(self, ops: HostKVOps) -> None:
        """Start a step's copies (before its forward)."""
        if ops.swap_out:  # first: a swap-in may reuse the device blocks a swap-out reads
            copy_blocks(self.device_cache, self.host_cache, ops.swap_out)
        if ops.swap_in:
            copy_blocks(self.host_cache, self.device_cache, ops.swap_in)
        if not (ops.offload or ops.load):
            return
        if self.on_gpu:
            self._stream.wait_stream(torch.cuda.current_stream(self.device_cache.device))
            with torch.cuda.stream(self._stream):
                self._copy(ops)
                done = torch.cuda.Event()
                done.record(self._stream)
        else:
            done = self._thread.submit(self._copy, ops)
        self._in_flight.append((ops.job_id, done))

    @torch.inference_mode()
    def _copy(self, ops: HostKVOps) -> None:
        copy_blocks(self.device_cache, self.host_cache, ops.offload)
        copy_blocks(self.host_cache, self.device_cache, ops.load)

    def poll(self, wait_s: float = 0.0) -> list[int]:
        """Jobs whose copies landed, in order; waits up to `wait_s` for the oldest (a step with
        nothing else to do waits rather than spins)."""
        done = []
        deadline = time.monotonic() + wait_s
        while self._in_flight:
            job_id, marker = self._in_flight[0]
            if not self._landed(marker, deadline - time.monotonic() if not done else 0.0):
                break
            self._in_flight.popleft()
            done.append(job_id)
        return done

    def _landed(self, marker, wait_s: float) -> bool:
        if self.on_gpu:
            while not marker.query():
                if wait_s <= 0:
                    return False
                time.sleep(min(wait_s, 1e-4))
                wait_s -= 1e-4
            return True
        if wait_s > 0:
            try:
                marker.result(timeout=wait_s)
            except TimeoutError:
                return False
        if marker.done():
            marker.result()  # a copy that raised fails the step, not silently the KV
            return True
        return False

    def close(self) -> None:
        if not self.on_gpu:
            self._thread.shutdown(wait=True)
