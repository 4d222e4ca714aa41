"""KV handoff benchmark: the NIXL connector against a raw NIXL READ of the same bytes.

For each prompt length, a prefill side holds a prompt's KV blocks (its connector's
request_finished) and a decode side admits the request with the handle: the handoff is timed
from "prefill done" (before request_finished) to the decode worker reporting the load
finished, i.e. the moment the request can take its first decode step. The raw baseline
READs the same number of bytes in one descriptor between two fresh agents, in the same run.
The model is not run: only the cache's shape matters, so the Llama-3-8B shape (32 layers,
8 KV heads of 128) is measured without its weights, and DeepSeek-V2-Lite's (27 layers): its
multi-head latent attention caches one 576-value latent per token and layer, against 16 K and
V heads of 128 were its attention plain multi-head. Both sides live in this process, each
with its own NIXL agent (UCX, CPU memory).

    .venv/bin/python bench/kv_transfer.py
    .venv/bin/python bench/kv_transfer.py --lengths 512,2048 --fragmented
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from baton.engine.common.config import read_config
from baton.engine.common.sampling_params import SamplingParams
from baton.engine.common.scheduler_output import SchedulerOutput
from baton.engine.core.kv_cache_manager import KVCacheManager
from baton.engine.core.request import Request, RequestStatus
from baton.engine.worker.models import model_args
from baton.kv_transfer.base import KVFormat
from baton.kv_transfer.nixl_connector import make_nixl_connector, new_agent

REPO = Path(__file__).resolve().parent.parent
SHAPES = {  # name: (layers, kv heads, head dim, parts: K and V, or MLA's latent alone)
    "llama-3-8b": (32, 8, 128, 2),
    "deepseek-v2-lite-mla": (27, 1, 512 + 64, 1),
    "deepseek-v2-lite-as-mha": (27, 16, 128, 2),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="512,1024,2048,4096,8192", help="prompt lengths in tokens")
    p.add_argument("--demo-model", default="models/smollm2-135m-instruct", help="its config.json gives a shape")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="KV cache dtype")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5, help="timed runs per point; the median is reported")
    p.add_argument("--fragmented", action="store_true", help="shuffle the decode side's free blocks")
    p.add_argument("--shapes", default=None, help="comma list of shape names to run (default: all)")
    args = p.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    return args


def shapes(args) -> dict[str, tuple[int, int, int, int]]:
    out = {}
    model_dir = REPO / args.demo_model
    if (model_dir / "config.json").is_file():
        model = model_args(read_config(str(model_dir)))
        out[model_dir.name] = (model.num_layers, model.num_kv_heads, model.head_dim, model.kv_parts)
    out = {**out, **SHAPES}
    return {k: v for k, v in out.items() if args.shapes is None or k in args.shapes.split(",")}


class Side:
    """One engine's KV pool, block manager and connector halves, without a model."""

    def __init__(self, name: str, num_blocks: int, shape, args, shuffle: bool = False):
        layers, heads, head_dim, parts = shape
        self.cache = torch.zeros(num_blocks, layers, parts, args.block_size, heads, head_dim, dtype=DTYPES[args.dtype])
        self.kv = KVCacheManager(num_blocks, args.block_size, enable_caching=False)
        if shuffle:
            ids = list(self.kv.free_queue)
            random.Random(0).shuffle(ids)
            self.kv.free_queue = type(self.kv.free_queue)((i, self.kv.free_queue[i]) for i in ids)
        self.sched, self.worker = make_nixl_connector(name, args.block_size, hold_timeout_s=600)
        self.worker.register_kv_caches(self.cache, KVFormat("bench", args.dtype, layers, heads, head_dim,
                                                            args.block_size, "none"))

    def close(self):
        self.worker.close()


def handoff(prefill: Side, decode: Side, n_tokens: int, tag: str) -> tuple[float, float, int]:
    """Seconds from prefill done to the load reported, and until the prefill learns it was
    read; and the READ descriptors used."""
    p_req = Request(f"p-{tag}", list(range(n_tokens)), SamplingParams(max_tokens=1))
    p_req.hold_for_remote = True
    prefill.kv.allocate_slots(p_req, n_tokens)
    p_req.append_output_token(1)
    p_req.status = RequestStatus.FINISHED_LENGTH_CAPPED  # ended as asked: its blocks are held
    d_req = Request(f"d-{tag}", list(range(n_tokens)), SamplingParams(max_tokens=2))
    descriptors_before = decode.worker.num_descriptors

    t0 = time.perf_counter()  # prefill done
    hold, handle = prefill.sched.request_finished(p_req, prefill.kv.block_ids(p_req.request_id))
    if not hold:
        raise RuntimeError("the prefill side did not hold the blocks")
    prefill.worker.start_load_kv(prefill.sched.build_connector_meta(SchedulerOutput()))  # registers the hold
    d_req.remote_kv = handle
    num_external, _ = decode.sched.get_num_new_matched_tokens(d_req, 0)
    decode.kv.allocate_slots(d_req, num_external, cache=False)
    decode.sched.update_state_after_alloc(d_req, decode.kv.block_ids(d_req.request_id), num_external)
    decode.worker.start_load_kv(decode.sched.build_connector_meta(SchedulerOutput()))
    # Both sides poll, as both engines' step loops do (a peer in this process makes no UCX
    # progress unless polled).
    t1 = t2 = None
    while t1 is None or t2 is None:
        if t1 is None and d_req.request_id in decode.worker.get_finished().finished_recving:
            t1 = time.perf_counter()  # the request can take its first decode step
        if t2 is None and p_req.request_id in prefill.worker.get_finished().finished_sending:
            t2 = time.perf_counter()
    prefill.kv.free(p_req)
    decode.kv.free(d_req)
    return t1 - t0, t2 - t0, decode.worker.num_descriptors - descriptors_before


def raw_read(nbytes: int, repeats: int) -> float:
    """Median seconds of one READ of nbytes in one descriptor between two fresh agents."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    target, initiator = new_agent(f"raw-target-{nbytes}"), new_agent(f"raw-init-{nbytes}")
    regs = target.register_memory(src), initiator.register_memory(dst)
    peer = initiator.add_remote_agent(target.get_agent_metadata())
    peer = peer.decode() if isinstance(peer, bytes) else peer
    times = []
    for _ in range(repeats + 1):
        local = initiator.get_xfer_descs([(dst.data_ptr(), nbytes, 0)], "DRAM")
        remote = initiator.get_xfer_descs([(src.data_ptr(), nbytes, 0)], "DRAM")
        t0 = time.perf_counter()
        handle = initiator.initialize_xfer("READ", local, remote, peer, b"raw")
        initiator.transfer(handle)
        while initiator.check_xfer_state(handle) != "DONE":
            target.get_new_notifs()  # the same polling as the handoff gets
        times.append(time.perf_counter() - t0)
        initiator.release_xfer_handle(handle)
    assert bool(dst[-1] == 1)
    target.deregister_memory(regs[0])
    initiator.deregister_memory(regs[1])
    return statistics.median(times[1:])  # the first pays for connection set-up


def main() -> None:
    args = parse_args()
    print(f"KV dtype {args.dtype}, block size {args.block_size}, {args.repeats} runs per point (median), "
          f"decode free blocks {'shuffled' if args.fragmented else 'in order'}")
    rows = [["shape", "tokens", "MiB", "descriptors", "handoff ms", "freed on prefill ms", "raw READ ms",
             "handoff GB/s", "raw GB/s", "bandwidth vs raw", "handoff - raw ms"]]
    for name, shape in shapes(args).items():
        layers, heads, head_dim, parts = shape
        bytes_per_token = layers * parts * heads * head_dim * DTYPES[args.dtype].itemsize
        num_blocks = -(-max(args.lengths) // args.block_size) + 1
        prefill = Side(f"bench-prefill-{name}", num_blocks, shape, args)
        decode = Side(f"bench-decode-{name}", num_blocks, shape, args, shuffle=args.fragmented)
        decode.worker.add_peer(prefill.worker.layout)
        prefill.worker.add_peer(decode.worker.layout)
        try:
            handoff(prefill, decode, args.block_size, "warmup")
            for n in args.lengths:
                runs = [handoff(prefill, decode, n, f"{n}-{i}") for i in range(args.repeats)]
                h = statistics.median(r[0] for r in runs)
                freed = statistics.median(r[1] for r in runs)
                nbytes = -(-n // args.block_size) * args.block_size * bytes_per_token
                raw = raw_read(nbytes, args.repeats)
                rows.append([name, str(n), f"{nbytes / 2**20:.1f}", str(runs[-1][2]), f"{h * 1e3:.2f}",
                             f"{freed * 1e3:.2f}", f"{raw * 1e3:.2f}", f"{nbytes / h / 1e9:.2f}",
                             f"{nbytes / raw / 1e9:.2f}", f"{raw / h:.2f}", f"{(h - raw) * 1e3:+.2f}"])
                print(f"  {name} {n} tokens done", flush=True)
        finally:
            prefill.close()
            decode.close()
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    print("\n" + "\n".join(lines))
    print("\nhandoff: prefill done -> decode's load reported (the request may step); bandwidth vs raw = raw time / "
          "handoff time for the same bytes")


if __name__ == "__main__":
    main()
