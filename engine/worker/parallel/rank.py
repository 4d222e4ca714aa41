"""A tensor-parallel rank of an engine (ranks 1..N-1; rank 0 runs in the engine core's process):
`python -m baton.engine.worker.parallel.rank`, its RankStart pickled on stdin. It loads the
checkpoint, keeps its share, builds a runner like rank 0's (with its own KV connector worker
where the engine has one: its own NIXL agent over its own cache), then runs every step the
core hands over until told to stop. It never samples: rank 0's tokens come with the next step.
It tells the core, on a ring of its own, which KV loads and host-tier copies ended here.

Exits 0 when told to stop, 1 when it fails (the core sees that and fails the engine), and is
killed with the core (PR_SET_PDEATHSIG, and a check of the parent while it waits). Started
through lifetime.child_argv: it ignores SIGINT, the core's front stops the engine on Ctrl-C."""
from __future__ import annotations

import datetime
import logging
import os
import pickle
import sys

import torch
import torch.distributed as dist

from baton.engine.common.config import read_config
from baton.engine.common.core_messages import error_of
from baton.engine.common.lifetime import die_with_parent
from baton.engine.worker.loader import load_model
from baton.engine.worker.lora.layers import LoRASlots
from baton.engine.worker.lora.registry import LoRARegistry, start_lora
from baton.engine.worker.model_runner import ModelRunner
from baton.engine.worker.models import model_args
from baton.engine.worker.parallel.rank_messages import (
    RankAdapter,
    RankAddPeer,
    RankReady,
    RankReport,
    RankStart,
    RankStep,
    RankStop,
    RunnerSetup,
)
from baton.engine.worker.parallel.shm_broadcast import ShmBroadcast
from baton.engine.worker.parallel.tensor_parallel import TPGroup, shard_model
from baton.engine.worker.queued_step import QueuedStep

log = logging.getLogger("baton.tp")

# Tests set it to a rank's number: that rank exits (status 3) between saying it is ready and
# meeting the others, as a rank that crashed there would.
EXIT_BEFORE_JOIN = "BATON_TEST_RANK_EXITS_BEFORE_JOIN"


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: the core's for rank 0, the r-th GPU after it for the others."""
    if device == "cpu":
        return device
    return f"cuda:{int(device.split(':')[1]) + rank}"


def main() -> None:
    start: RankStart = pickle.load(sys.stdin.buffer)
    die_with_parent(start.parent)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{start.rank} %(levelname)s %(message)s")
    torch.set_num_threads(start.threads)
    config = start.config
    size = config.tensor_parallel_size
    store = dist.TCPStore("127.0.0.1", start.store_port, size, False, timeout=datetime.timedelta(seconds=600))
    ring = ShmBroadcast.attach(start.ring_path, size - 1, start.rank - 1)
    back = ShmBroadcast.attach(start.back_path, 1, -1)  # (both mapped before the core unlinks them)

    def alive() -> bool:
        return os.getppid() == start.parent

    device = torch.device(rank_device(config.device, start.rank))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    whole = model_args(read_config(config.model))
    try:  # in host memory: only this rank's share goes to the device
        model = load_model(config.model, config.torch_dtype(whole.torch_dtype), "cpu")
    except Exception as e:  # noqa: BLE001 - the core raises it as its own start-up error
        store.set(f"ready{start.rank}", pickle.dumps(RankReady(error_of(e))))
        sys.exit(1)
    store.set(f"ready{start.rank}", pickle.dumps(RankReady()))
    if os.environ.get(EXIT_BEFORE_JOIN) == str(start.rank):  # a test's fault: dead before the rendezvous
        os._exit(3)
    shard_model(model, TPGroup.join(start.rank, size, store, device), config.enable_expert_parallel)
    model.to(device)
    setup: RunnerSetup = ring.recv(alive)
    setup.config.device = str(device)
    connector = start.connector() if start.connector is not None else None
    loras, slots = start_lora(setup.config, whole, model, model.embed_tokens.weight.dtype)
    runner = ModelRunner(model, setup.config, setup.num_kv_blocks, setup.eos_token_ids, connector, slots,
                         setup.num_host_blocks, setup.kv_groups, driver=False, draft_format=setup.draft_format)
    if connector is not None:  # rank 0 gathers every rank's layout for the handshake
        store.set(f"layout{start.rank}", pickle.dumps(connector.layout))
    runner.capture_graphs()  # with rank 0 (once it has the layouts): their collectives pair up
    in_flight: QueuedStep | None = None  # (async scheduling) the step queued last, its tokens not taken
    try:
        while not isinstance(msg := ring.recv(alive), RankStop):
            if isinstance(msg, RankAddPeer):
                connector.add_peer(msg.layout)
                continue
            if isinstance(msg, RankAdapter):
                _follow_adapter(loras, slots, msg)
                continue
            step: RankStep = msg
            if in_flight is not None and not step.ahead:  # a step run at once: the one in flight taken first
                in_flight.result()
                in_flight = None
            runner.mirror(step.sampled)
            if step.ahead:  # as rank 0's StepLoop: queued, then the one before taken
                queued = runner.submit(step.sched)
                if in_flight is not None:
                    in_flight.result()
                in_flight, out = queued, queued.transfers
            else:
                out = runner.execute_model(step.sched)
            kv = out.kv_connector_output
            report = RankReport(start.rank, kv.finished_recving if kv else set(), kv.invalid_by_request if kv else {},
                                out.host_kv_finished)
            if report:
                back.send(report, alive)
    except Exception:
        log.exception("tensor-parallel rank %d failed", start.rank)
        os._exit(1)
    if connector is not None:
        connector.close()
    os._exit(0)  # torch's threads must not hold the exit up


def _follow_adapter(loras: LoRARegistry, slots: LoRASlots, msg: RankAdapter) -> None:
    """Load or unload an adapter as rank 0 did (rank 0 checked it: it is not in use)."""
    if msg.unload:
        loras.unload(msg.name, 0)
        slots.forget(msg.adapter_id)
        return
    info = loras.load(msg.name, msg.path)
    if info.adapter_id != msg.adapter_id:
        raise RuntimeError(f"adapter {msg.name!r} got id {info.adapter_id} here, {msg.adapter_id} on rank 0")


if __name__ == "__main__":
    main()
