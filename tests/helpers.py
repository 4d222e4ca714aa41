"""Helpers the test modules share: workloads, the greedy reference check, the tiny blocks' size,
offline runs that check no block leaked and speculative runs against plain ones, stream
collection, and waiting on a server's health and pools through its gRPC services
(servers start in servers.py, fixtures live in conftest.py)."""
from __future__ import annotations

import random
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton import SamplingParams
from baton.services.rpc.health import backend_health, is_serving

TINY_BLOCK_BYTES = 4 * 2 * 16 * 2 * 16 * 4  # the tiny checkpoints' float32 block: layers, K/V, 16 tokens, heads, dim


def gib(num_blocks: int) -> float:
    """kv_offloading_size for that many of the tiny checkpoints' blocks."""
    return num_blocks * TINY_BLOCK_BYTES / (1 << 30)


GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def assert_matches_hf(hf, model_dir, prompts, outputs, max_tokens=GREEDY.max_tokens):
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == hf.greedy(model_dir, prompt, max_tokens), f"prompt of {len(prompt)} tokens"
        assert out.finish_reason == "length"


TOKEN = "stack-secret"  # the internal token the tests' tiers share
AUTH = (("x-baton-token", TOKEN),)


def random_prompts(lengths, seed=0, vocab=500) -> list[list[int]]:
    """Token-id prompts of the given lengths, above the special ids at the bottom of the vocab."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def random_images(seed: int, sizes) -> list:
    """Pictures of random pixels ([height, width, 3] uint8 arrays) of the given (height, width) sizes."""
    import numpy as np

    gen = np.random.default_rng(seed)
    return [gen.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]


def workload(n=32, seed=0):
    """Mixed lengths; even requests greedy, odd ones seeded sampling."""
    rng = random.Random(seed)
    prompts = random_prompts([rng.randint(2, 120) for _ in range(n)], seed)
    params = [dict(max_tokens=rng.randint(4, 40), ignore_eos=True,
                   **({"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.9, "top_p": 0.9, "seed": 1000 + i}))
              for i in range(n)]
    return prompts, params


async def collect(client, prompt, **kwargs) -> tuple[list[int], str, object]:
    """One stream from an AsyncClient: its token ids, its text, and its last chunk."""
    ids, text, last = [], "", None
    async for chunk in client.generate(prompt, **kwargs):
        ids += chunk.token_ids
        text += chunk.text
        last = chunk
    return ids, text, last


def health_status(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=5).status


def greedy_through(address: str, prompts, max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy token ids (EOS ignored) streamed from the server at `address` (a router,
    or an engine), one request after the other."""
    from baton.services.client import Client

    with Client(address) as client:
        return [[t for c in client.generate(p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=60)
                 for t in c.token_ids] for p in prompts]


def wait_serving(address: str, timeout: float = 30.0, tls=None) -> None:
    """Until the server serves (a router: and sees each of its backends healthy)."""
    deadline = time.monotonic() + timeout
    while not (is_serving(address, tls=tls) and (health := backend_health(address, tls)) is not None
               and all(health)):
        assert time.monotonic() < deadline, f"{address} never served"
        time.sleep(0.05)


def stats(address: str):
    """A server's EngineStats, through the internal Admin service."""
    from baton.v1 import internal_pb2, internal_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        return internal_pb2_grpc.AdminStub(channel).Stats(internal_pb2.StatsRequest(), metadata=AUTH, timeout=10)


def pools_full(address: str, timeout: float = 10.0) -> bool:
    """Waits (bounded) until every KV block of the server's tiers is free, nothing held or streaming."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = stats(address)
        if (s.num_free_kv_blocks == s.num_kv_blocks and s.num_held == 0 and s.num_in_flight_streams == 0
                and s.num_free_host_kv_blocks == s.num_host_kv_blocks):
            return True
        time.sleep(0.05)
    return False


def run_llm(model_dir, ps, params, **engine):
    """An offline engine's outputs of `ps` (its LLM too); every block back in the pool after."""
    from baton import LLM

    llm = LLM(model_dir, dtype="float32", device="cpu", **engine)
    outs = llm.generate(ps, params)
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks  # no block leaked, drafts or not
    return llm, outs


def drafted_and_plain(model_dir, speculative_config):
    """Six prompts (the last sharing three blocks with the fourth), greedy and seeded-sampled in
    turn, run without drafts and with `speculative_config` on a small pool in 32-token chunks:
    (prompts, plain token ids, drafted token ids). Asserts the drafted run preempted, hit the
    prefix cache, drafted, and repeats itself."""
    ps = random_prompts([5, 23, 40, 61, 90], seed=17)
    ps.append(ps[3][:48] + ps[0])  # shares three blocks with the fourth
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True)] * 3
    _, want = run_llm(model_dir, ps, params)
    engine = dict(speculative_config=speculative_config, max_num_batched_tokens=32, num_kv_blocks=16,
                  max_model_len=192)
    llm, got = run_llm(model_dir, ps, params, **engine)
    scheduler = llm.engine.core.scheduler
    assert scheduler.num_preemptions > 0 and llm.engine.kv.prefix_hits > 0
    assert scheduler.spec_stats.num_draft_tokens > 0
    assert [o.token_ids for o in run_llm(model_dir, ps, params, **engine)[1]] == [o.token_ids for o in got]
    return ps, [o.token_ids for o in want], [o.token_ids for o in got]


def alive(pid: int) -> bool:
    """Whether pid runs (a zombie has exited: it only waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def assert_image_prompts_as_reference(model_dir: str, prompts: list, prompt_ids, reference, **engine) -> list:
    """`prompts`: (parts, pictures) each, `prompt_ids(model_dir, *parts)` its token ids; in one
    batch of an engine with `engine`'s args, greedy outputs equal `reference(model_dir, ids,
    pictures, n)`'s, another picture changes the second prompt's output (else the check could not
    fail), and the pool ends full. Returns the outputs."""
    from baton import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    requests = [{"prompt_token_ids": prompt_ids(model_dir, *parts), "multi_modal_data": {"image": pics}} if pics else
                {"prompt_token_ids": prompt_ids(model_dir, *parts)} for parts, pics in prompts]
    llm = LLM(model_dir, dtype="float32", device="cpu", **engine)
    outs = llm.generate(requests, greedy)
    assert [o.token_ids for o in outs] == [reference(model_dir, r["prompt_token_ids"], pics, greedy.max_tokens)
                                           for r, (_, pics) in zip(requests, prompts)]
    others = [pic for _, pics in prompts for pic in pics if pic is not prompts[1][1][0]]
    other = llm.generate({**requests[1], "multi_modal_data": {"image": others[-1]}}, greedy)[0]
    assert other.token_ids != outs[1].token_ids
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks
    return outs
