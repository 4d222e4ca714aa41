"""bench/gpu_perf.py's engines and synthetic steps: random checkpoints written once per run, an
LLM started on one, its ModelRunner driven directly (decodes of B requests at context C over a
KV cache of random values, one-step prefills), the floors those steps are measured against (the
bytes they must read over the copy bandwidth), the device's busy share of a step, and an
offline generate of the serve section's workload."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time

import numpy as np
import torch
from gpu_perf_run import FIRST_ID, GIB, Plan, Run, stats_ms, sync  # bench/gpu_perf_run.py


def llama_checkpoint(run: Run) -> str:
    """The Llama checkpoint, written once per run (drawn on the GPU there)."""
    if run.llama_dir is None:
        from random_checkpoint import SHAPES, write_random_checkpoint

        d = SHAPES[run.plan.llama_shape]
        h, inter, layers, v = d["hidden_size"], d["intermediate_size"], d["num_hidden_layers"], d["vocab_size"]
        kv = h // d["num_attention_heads"] * d["num_key_value_heads"]
        params = 2 * v * h + layers * (2 * h * h + 2 * h * kv + 3 * h * inter)
        folder = run.scratch_dir(2 * params)
        t0 = time.perf_counter()
        write_random_checkpoint(folder, run.plan.llama_shape, device=run.plan.device)
        run.llama_dir = folder
        run.report["llama_checkpoint"] = {"dir": folder, "gib": round(2 * params / GIB, 2),
                                          "write_s": round(time.perf_counter() - t0, 1)}
        run.save()
    return run.llama_dir


def write_moe_checkpoint(folder: str, shape: dict, layers: int, device: str, seed: int = 0) -> dict:
    """A Qwen3-MoE checkpoint of random bf16 weights (std 0.02, norms at 1) as the published ones
    lay it out (one tensor per expert and projection), drawn on `device`, a shard per layer;
    the tests' small tokenizer. Returns its layers and size."""
    from safetensors.torch import save_file

    from baton.testing.checkpoints import train_tokenizer

    s = shape
    h, hd, inter, experts = s["hidden_size"], s["head_dim"], s["moe_intermediate_size"], s["num_experts"]
    q, kv = s["num_attention_heads"] * hd, s["num_key_value_heads"] * hd
    gen = torch.Generator(device).manual_seed(seed)

    def normal(*dims):
        return (torch.randn(*dims, generator=gen, device=device) * 0.02).to(torch.bfloat16).cpu()

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    num_shards, weight_map = layers + 1, {}

    def save(n: int, tensors: dict) -> None:
        name = f"model-{n + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file(tensors, os.path.join(folder, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))

    save(0, {"model.embed_tokens.weight": normal(s["vocab_size"], h), "lm_head.weight": normal(s["vocab_size"], h),
             "model.norm.weight": ones(h)})
    for i in range(layers):
        p = f"model.layers.{i}."
        shard = {p + "self_attn.q_proj.weight": normal(q, h), p + "self_attn.k_proj.weight": normal(kv, h),
                 p + "self_attn.v_proj.weight": normal(kv, h), p + "self_attn.o_proj.weight": normal(h, q),
                 p + "self_attn.q_norm.weight": ones(hd), p + "self_attn.k_norm.weight": ones(hd),
                 p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
                 p + "mlp.gate.weight": normal(experts, h)}
        for j in range(experts):
            e = f"{p}mlp.experts.{j}."
            shard.update({e + "gate_proj.weight": normal(inter, h), e + "up_proj.weight": normal(inter, h),
                          e + "down_proj.weight": normal(h, inter)})
        save(i + 1, shard)
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    tokenizer = train_tokenizer()
    tokenizer.save_pretrained(folder)
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **s, "num_hidden_layers": layers,
              "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu", "rms_norm_eps": 1e-6,
              "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": False,
              "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
              "torch_dtype": "bfloat16", "bos_token_id": tokenizer.bos_token_id,
              "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    with open(os.path.join(folder, "config.json"), "w") as f:  # last: a folder with config.json is complete
        json.dump(config, f, indent=1)
    written = sum(os.path.getsize(os.path.join(folder, n)) for n in set(weight_map.values()))
    return {"layers": layers, "gib": round(written / GIB, 2)}


def moe_bytes(shape: dict, layers: int) -> int:
    s = shape
    h, hd = s["hidden_size"], s["head_dim"]
    attn = 2 * h * s["num_attention_heads"] * hd + 2 * h * s["num_key_value_heads"] * hd
    experts = s["num_experts"] * (3 * h * s["moe_intermediate_size"] + h)
    return 2 * (2 * s["vocab_size"] * h + layers * (attn + experts))


def engine_args(plan: Plan, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                capture: tuple[int, ...]) -> dict:
    """LLM's keyword arguments: the plan's device and dtype, no prefix caching, the pool from
    gpu_memory_utilization (0.9) on a GPU; graphs captured at `capture` only (where this tree's
    EngineConfig has cudagraph_capture_sizes): the batches measured, not 35 sizes."""
    from baton.engine.common.config import EngineConfig

    kw = dict(device=plan.device, dtype=plan.dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=False)
    if plan.device == "cuda":
        kw["gpu_memory_utilization"] = 0.9
    else:
        kw["num_kv_blocks"] = plan.cpu_kv_blocks
    if "cudagraph_capture_sizes" in {f.name for f in dataclasses.fields(EngineConfig)}:
        kw["cudagraph_capture_sizes"] = sorted(set(capture))
    return kw


def llama_engine_args(plan: Plan) -> dict:
    return engine_args(plan, max(plan.contexts) + 256, max(plan.batches), max(plan.prefill), plan.batches)


def start_engine(path: str, kwargs: dict, row: dict):
    from baton import LLM

    t0 = time.perf_counter()
    llm = LLM(path, **kwargs)
    runner = llm.engine.runner
    graphs = getattr(runner, "graphs", None)
    off = getattr(runner, "graphs_off", "this tree has no ModelRunner.graphs")
    row["engine"] = {"start_s": round(time.perf_counter() - t0, 1), "args": kwargs,
                     "num_kv_blocks": llm.engine.num_kv_blocks, "block_size": runner.block_size,
                     "attention_backend": runner.attention_backend,
                     "graphs": (f"captured for {list(graphs.sizes)}" if graphs is not None else
                                f"not available ({off})")}
    return llm


def fill_kv_random(runner) -> None:
    """Random values in every block (not zeros: what a decode reads should be what it would)."""
    cache = runner.kv_cache
    per_block = cache[0].numel() * cache.element_size()
    chunk = max(1, GIB // per_block)
    with torch.inference_mode():  # (the cache may be an inference tensor)
        for start in range(0, cache.shape[0], chunk):
            cache[start:start + chunk].normal_()
    sync(runner.device.type)


@contextlib.contextmanager
def graphs_enabled(runner, on: bool):
    graphs = getattr(runner, "graphs", None)
    if graphs is None:
        yield
        return
    before, graphs.enabled = graphs.enabled, on
    try:
        yield
    finally:
        graphs.enabled = before


def modes(runner) -> tuple[str, ...]:
    return ("graphs", "eager") if getattr(runner, "graphs", None) is not None else ("eager",)


def blocks_needed(runner, batch: int, context: int, max_steps: int) -> tuple[int, int]:
    """(blocks B requests of context C need for max_steps more tokens, blocks in the pool)."""
    return batch * -(-(context + max_steps + 1) // runner.block_size), runner.kv_cache.shape[0]


class DecodeBatch:
    """B requests of context C decoding one token a step, straight through the runner: the
    first step adds them with C random tokens, C - 1 computed (so its one token is a decode that
    samples), the rest follow as cached requests (the runner appends what it sampled); closing
    drops them. Each request's blocks: distinct, drawn from the whole pool."""

    def __init__(self, runner, batch: int, context: int, max_steps: int, rng: np.random.Generator, tag: str):
        from baton.engine.common.sampling_params import SamplingParams
        from baton.engine.common.scheduler_output import NewRequestData

        self.runner, self.batch, self.context = runner, batch, context
        self.per_request = -(-(context + max_steps + 1) // runner.block_size)
        self.need, self.pool = blocks_needed(runner, batch, context, max_steps)
        self.ids = [f"{tag}-{i}" for i in range(batch)]
        self.step_no = 0
        self.sampled = 0
        if not self.fits:
            return
        blocks = rng.permutation(self.pool)[:self.need]
        groups = len(runner.kv_groups.layers)
        vocab = runner.model.args.vocab_size
        params = SamplingParams(max_tokens=max_steps + 8, temperature=0.0, ignore_eos=True)
        self.new = [NewRequestData(r, rng.integers(FIRST_ID, vocab, context).tolist(),
                                   [blocks[i * self.per_request:(i + 1) * self.per_request].tolist()] * groups,
                                   context - 1, params, context - 1) for i, r in enumerate(self.ids)]

    @property
    def fits(self) -> bool:
        return self.need <= self.pool

    def step(self) -> float:
        """One step; its wall time (execute_model ends in a device sync: the sampled tokens
        come to the host)."""
        from baton.engine.common.scheduler_output import CachedRequestData, SchedulerOutput

        if self.step_no == 0:
            sched = SchedulerOutput(scheduled_new_reqs=self.new)
        else:
            sched = SchedulerOutput(scheduled_cached_reqs=[
                CachedRequestData(r, [[]], self.context - 1 + self.step_no) for r in self.ids])
        sched.num_scheduled_tokens = dict.fromkeys(self.ids, 1)
        sched.total_num_scheduled_tokens = self.batch
        t0 = time.perf_counter()
        out = self.runner.execute_model(sched)
        elapsed = time.perf_counter() - t0
        self.step_no += 1
        self.sampled = len(out.sampled_token_ids)
        return elapsed

    def close(self) -> None:
        from baton.engine.common.scheduler_output import SchedulerOutput

        if self.fits and self.step_no:
            self.runner.execute_model(SchedulerOutput(finished_req_ids=set(self.ids)))


def decode_run(runner, batch: int, context: int, plan: Plan, rng, tag: str) -> dict:
    d = DecodeBatch(runner, batch, context, plan.warmup + plan.steps, rng, tag)
    try:
        times = [d.step() for _ in range(plan.warmup + plan.steps)][plan.warmup:]
    finally:
        d.close()
    s = stats_ms(times)
    return {**s, "tok_s": round(batch / (s["median_ms"] / 1e3), 1), "sampled_per_step": d.sampled}


def weight_figures(model) -> dict:
    """Bytes and parameters the model's steps read: every parameter once (a tied head's shared),
    the input embedding table aside (a step gathers rows of it, unless it is the tied head)."""
    params = list(model.parameters())
    total = sum(p.numel() * p.element_size() for p in params)
    embed, head = model.embed_tokens.weight, model.lm_head.weight
    tied = head is embed  # (the loader ties them so)
    embed_bytes = 0 if tied else embed.numel() * embed.element_size()
    args, size = model.args, embed.element_size()
    experts = [(p.shape[0], p.numel() * p.element_size()) for n, p in model.named_parameters() if ".experts." in n]
    return {"read_bytes": total - embed_bytes, "row_bytes": embed.shape[1] * embed.element_size(),
            # prefill's matmuls: every parameter but the embedding and the head (one row a request)
            "matmul_params": sum(p.numel() for p in params) - embed.numel() - (0 if tied else head.numel()),
            "kv_token_bytes": args.num_layers * args.kv_parts * args.num_kv_heads * args.head_dim * size,
            "expert_bytes": sum(b for _, b in experts), "num_experts": experts[0][0] if experts else 0,
            "top_k": getattr(args, "num_experts_per_tok", 0) or 0}


def decode_floor_s(w: dict, batch: int, context: int, bandwidth: float, moe: bool = False) -> tuple[float, float]:
    """(floor seconds, bytes) of a decode step: its weights (for a MoE, less the experts the
    batch is not expected to hit) and the KV it attends over, over the copy bandwidth."""
    weights = w["read_bytes"] + batch * w["row_bytes"]
    if moe and w["num_experts"]:
        e, k = w["num_experts"], w["top_k"]
        hit = e * (1 - (1 - k / e) ** batch)
        weights -= w["expert_bytes"] * (1 - hit / e)
    total = weights + batch * context * w["kv_token_bytes"]
    return total / bandwidth, total


def with_floor(entry: dict, floor_s: float) -> None:
    entry["itl_over_floor"] = round(entry["median_ms"] / (floor_s * 1e3), 3)
    entry["tput_share_of_floor"] = round(floor_s * 1e3 / entry["median_ms"], 3)


def decode_grid(run: Run, runner, w: dict, grid: list[tuple[int, int]], table: dict, tag: str, moe: bool = False):
    """Each (batch, context) of grid, in each mode, into table["B{b} C{c}"]; saved as it goes."""
    rng = np.random.default_rng(1)
    bw = run.ceilings.get("copy_bytes_per_s")
    for batch, context in grid:
        entry = table[f"B{batch} C{context}"] = {}
        need, pool = blocks_needed(runner, batch, context, run.plan.warmup + run.plan.steps)
        if need > pool:
            entry["skipped"] = f"does not fit: needs {need} blocks, the pool has {pool}"
            continue
        if run.left() < 5:
            entry["skipped"] = "out of time"
            continue
        if bw:
            floor, nbytes = decode_floor_s(w, batch, context, bw, moe)
            entry["floor_ms"], entry["floor_gb_per_step"] = round(floor * 1e3, 3), round(nbytes / 1e9, 2)
        for mode in modes(runner):
            with graphs_enabled(runner, mode == "graphs"):
                entry[mode] = decode_run(runner, batch, context, run.plan, rng, f"{tag}-{mode}-b{batch}c{context}")
            if bw:
                with_floor(entry[mode], floor)
        run.save()


def busy_share(runner, batch: int, context: int, plan: Plan, tag: str) -> dict:
    """The device's busy share of `busy_steps` decode steps: the union of its kernels' (and
    copies') intervals over the steps' wall time, by torch.profiler (CUDA activity only, so the
    host side is not slowed by recording ops). On a CPU: the union of the ATen ops'."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_gpu = runner.device.type == "cuda"
    d = DecodeBatch(runner, batch, context, plan.warmup + plan.busy_steps, np.random.default_rng(2), tag)
    if not d.fits:
        return {"skipped": f"does not fit: needs {d.need} blocks, the pool has {d.pool}"}
    try:
        for _ in range(plan.warmup):
            d.step()
        with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
            wall = sum(d.step() for _ in range(plan.busy_steps))
    finally:
        d.close()
    kind = DeviceType.CUDA if on_gpu else DeviceType.CPU
    work = {"kernel", "gpu_memcpy", "gpu_memset"} if on_gpu else {"cpu_op"}
    spans = sorted(_span_ns(e) for e in prof.profiler.kineto_results.events()
                   if e.device_type() == kind and _is_work(e, work))
    spans = [(a, b) for a, b in spans if b > a]
    busy, end = 0, -1
    for a, b in spans:  # the union of the intervals
        if b > end:
            busy += b - max(a, end)
            end = b
    busy_s = busy / 1e9
    return {"busy_share": round(busy_s / wall, 3), "step_ms": round(wall / plan.busy_steps * 1e3, 3),
            "device_busy_ms": round(busy_s / plan.busy_steps * 1e3, 3),
            "host_overhead_ms": round((wall - busy_s) / plan.busy_steps * 1e3, 3), "device_events": len(spans)}


def _is_work(event, kinds: set[str]) -> bool:
    """A kernel, copy or fill (an op on a CPU), not an annotation spanning idle time."""
    if hasattr(event, "activity_type"):
        return str(event.activity_type()) in kinds
    return not (hasattr(event, "is_user_annotation") and event.is_user_annotation())


def _span_ns(event) -> tuple[int, int]:
    """A kineto event's (start, end) in ns (torch before 2.1 gives microseconds only)."""
    if hasattr(event, "start_ns"):
        return event.start_ns(), event.start_ns() + event.duration_ns()
    return event.start_us() * 1000, (event.start_us() + event.duration_us()) * 1000


def prefill_run(runner, tokens: int, reps: int, rng, tag: str) -> list[float]:
    """One request of `tokens` computed in one step, reps + 1 times (the first a warm-up)."""
    from baton.engine.common.sampling_params import SamplingParams
    from baton.engine.common.scheduler_output import NewRequestData, SchedulerOutput

    blocks = rng.permutation(runner.kv_cache.shape[0])[:-(-(tokens + 1) // runner.block_size)].tolist()
    groups = len(runner.kv_groups.layers)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompt = rng.integers(FIRST_ID, runner.model.args.vocab_size, tokens).tolist()
    times = []
    for rep in range(reps + 1):
        rid = f"{tag}-{rep}"
        sched = SchedulerOutput(scheduled_new_reqs=[NewRequestData(rid, prompt, [blocks] * groups, 0, params, tokens)],
                                num_scheduled_tokens={rid: tokens}, total_num_scheduled_tokens=tokens)
        t0 = time.perf_counter()
        runner.execute_model(sched)
        times.append(time.perf_counter() - t0)
        runner.execute_model(SchedulerOutput(finished_req_ids={rid}))
    return times[1:]


def prefill_flops(w: dict, args, tokens: int) -> float:
    """2 x the matmul parameters per token, and causal attention's QK^T and PV (T^2 / 2 pairs)."""
    return 2 * w["matmul_params"] * tokens + 2 * 2 * tokens ** 2 / 2 * args.num_heads * args.head_dim * args.num_layers


def workload(plan: Plan, vocab: int) -> list[list[int]]:
    """The offline and served runs' prompts: the same random token ids for both."""
    rng = np.random.default_rng(7)
    return [rng.integers(FIRST_ID, vocab, plan.serve_input).tolist() for _ in range(plan.serve_requests)]


def offline_run(llm, plan: Plan) -> dict:
    from baton import SamplingParams

    prompts = workload(plan, llm.engine.vocab_size)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    times = llm.engine.times
    steps0, step_s0, sched_s0 = times.steps, times.step_s, times.scheduler_s
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=plan.serve_output, temperature=0.0, ignore_eos=True))
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return {"requests": len(prompts), "input_len": plan.serve_input, "output_len": plan.serve_output,
            "seconds": round(wall, 3), "output_tokens": tokens, "output_tok_s": round(tokens / wall, 1),
            "steps": times.steps - steps0, "step_s": round(times.step_s - step_s0, 3),
            "scheduler_share": round((times.scheduler_s - sched_s0) / wall, 4)}
