"""Whether peers can READ this engine's KV cache, found at start-up rather than at the first
request: UCX built without its CUDA transports (cuda_copy, cuda_ipc) registers GPU memory
but fails every READ of it, and a decode would then recompute every prompt."""
from __future__ import annotations

import logging
import threading
import time

import torch

from baton.kv_transfer.base import KVUnreachable

log = logging.getLogger("baton.kv_transfer")


_STRANDED: list = []  # probe buffers a transfer may still write to (its handle would not release)


def probe_read(agent, lock: threading.Lock, layout, kv_cache: torch.Tensor, probe_agent,
               timeout_s: float = 10.0) -> None:
    """A READ of the cache's first block (registered on `agent`, described by `layout`) by
    `probe_agent`, a second agent in this process, into memory on the same device, through
    the same backend, as a peer's READ would go: the block holds a pattern for the READ, and
    the probe other bytes, so a READ that moves nothing fails too. Raises KVUnreachable saying
    what failed."""
    size = layout.block_bytes
    block = kv_cache[0].view(-1).view(torch.uint8)
    saved = block.clone()
    block.copy_(torch.arange(size, device=block.device) % 251 + 1)
    probe = torch.zeros(size, dtype=torch.uint8, device=kv_cache.device)
    if kv_cache.is_cuda:  # UCX copies on streams of its own: torch's writes must have landed
        torch.cuda.synchronize(kv_cache.device)
    reg = handle = name = None
    try:
        reg = probe_agent.register_memory(probe)
        name = probe_agent.add_remote_agent(layout.agent_metadata)
        descs = [probe_agent.get_xfer_descs([(addr, size, layout.dev_id)], layout.mem_type)
                 for addr in (probe.data_ptr(), layout.base_addr)]
        handle = probe_agent.initialize_xfer("READ", *descs, name, b"")
        state, deadline = probe_agent.transfer(handle), time.monotonic() + timeout_s
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(0.001)
            with lock:
                agent.get_new_notifs()  # the target side moves only when polled
            state = probe_agent.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"the READ ended in {state}" if state != "PROC" else f"no READ within {timeout_s:g}s")
        if not torch.equal(probe, block):
            raise RuntimeError("the READ reported done, but the block's bytes did not arrive")
    except Exception as e:  # said once, as why the engine cannot start
        raise KVUnreachable(f"the KV connector cannot move KV blocks in {layout.mem_type} on {kv_cache.device} over "
                           f"NIXL/UCX ({e}); for GPU memory UCX needs its CUDA transports (cuda_copy, cuda_ipc: see "
                           f"`ucx_info -d`, and UCX_TLS if set)") from e
    finally:
        block.copy_(saved)
        _cleanup(probe_agent, handle, name, reg, probe)


def _cleanup(probe_agent, handle, name, reg, probe: torch.Tensor) -> None:
    """Each step on its own: one that fails (a transfer still active cannot be released)
    must neither hide the KVUnreachable nor skip the rest."""
    steps = [(handle, probe_agent.release_xfer_handle),
             (name, lambda n: probe_agent.remove_remote_agent(n.decode() if isinstance(n, bytes) else n)),
             (reg, probe_agent.deregister_memory)]
    for value, step in steps:
        if value is None:
            continue
        try:
            step(value)
        except Exception as e:  # noqa: BLE001
            log.warning("KV probe clean-up: %s", e)
            if step is probe_agent.release_xfer_handle:
                _STRANDED.append(probe)  # the transfer may still write into it
