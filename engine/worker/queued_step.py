"""A step queued under async scheduling (engine/core/engine_core.py): its work on the device and
its sampled tokens on their way to the host by a non-blocking copy into pinned memory, the
step's one wait on the device, taken by `result()` once the next step is queued behind it."""
from __future__ import annotations

from collections.abc import Callable

import torch

from baton.engine.common.scheduler_output import ModelRunnerOutput


class PinnedRing:
    """Host buffers for queued steps' tokens, reused in turn (a step's is read before the step
    after next refills it: at most two are queued), pinned where the tokens come from a GPU."""

    def __init__(self, size: int, device: torch.device, count: int = 3):
        self.buffers = [torch.empty(size, dtype=torch.int64, pin_memory=device.type == "cuda") for _ in range(count)]
        self.turn = 0

    def next(self, n: int) -> torch.Tensor:
        if n > self.buffers[0].numel():  # (never more rows than max_num_seqs; grown if so)
            self.buffers = [torch.empty(n, dtype=torch.int64, pin_memory=b.is_pinned()) for b in self.buffers]
        self.turn = (self.turn + 1) % len(self.buffers)
        return self.buffers[self.turn][:n]


class QueuedStep:
    def __init__(self, req_ids: list[str], tokens: torch.Tensor | None,
                 take: Callable[[list[str], list[int]], ModelRunnerOutput], ring: PinnedRing | None = None):
        """`tokens`: one per request of req_ids, on the device (None: a step that sampled
        nothing); `take(req_ids, tokens)`: the runner's, once they are on the host."""
        self.req_ids, self.take = req_ids, take
        self.host = self.ready = None
        # The transfers (KV connector's, host tier's) that ended by the time it was queued: the runner's.
        self.transfers: ModelRunnerOutput | None = None
        if tokens is not None:
            self.host = ring.next(len(req_ids)) if ring is not None else torch.empty(len(req_ids), dtype=torch.int64)
            self.host.copy_(tokens, non_blocking=True)
            if tokens.device.type == "cuda":
                self.ready = torch.cuda.Event()
                self.ready.record()

    def result(self) -> ModelRunnerOutput:
        """The step's output, once its tokens landed (waits for the device up to then)."""
        if self.host is None:
            out = ModelRunnerOutput({})
        else:
            if self.ready is not None:
                self.ready.synchronize()
            out = self.take(self.req_ids, self.host.tolist())
        if self.transfers is not None:
            out.kv_connector_output, out.host_kv_finished = (self.transfers.kv_connector_output,
                                                             self.transfers.host_kv_finished)
        return out
