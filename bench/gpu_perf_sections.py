"""bench/gpu_perf.py's sections but serve: the GPU's ceilings, the Llama-8B-shaped engine's
decode, prefill and busy share against their floors and targets, transformers on the same
checkpoint, and a Qwen3-30B-A3B-shaped MoE."""
from __future__ import annotations

import shutil
import time

import numpy as np
import torch
from gpu_perf_engine import (  # bench/gpu_perf_engine.py
    busy_share,
    decode_grid,
    engine_args,
    fill_kv_random,
    graphs_enabled,
    llama_checkpoint,
    llama_engine_args,
    modes,
    moe_bytes,
    offline_run,
    prefill_flops,
    prefill_run,
    start_engine,
    weight_figures,
    write_moe_checkpoint,
)
from gpu_perf_run import (  # bench/gpu_perf_run.py
    FIRST_ID,
    GIB,
    QWEN3_30B_A3B,
    QWEN3_30B_A3B_LAYERS,
    OutOfTime,
    Plan,
    Run,
    free_memory,
    stats_ms,
    sync,
    timed_s,
)


def section_ceilings(run: Run, row: dict) -> None:
    plan, dev = run.plan, run.plan.device
    row.update(device_facts(dev))
    copy = copy_times(plan.copy_bytes, dev)
    bw = 2 * plan.copy_bytes / float(np.median(copy))  # read and written
    row["copy"] = {"bytes": plan.copy_bytes, **stats_ms(copy), "tb_per_s": round(bw / 1e12, 3)}
    n, dtype = plan.matmul_n, getattr(torch, plan.dtype)
    gen = torch.Generator(dev).manual_seed(0)
    a = torch.randn(n, n, device=dev, generator=gen).to(dtype)
    b = torch.randn(n, n, device=dev, generator=gen).to(dtype)
    mm = timed_s(lambda: a @ b, dev, repeat=10)
    peak = 2 * n ** 3 / float(np.median(mm))
    row["matmul"] = {"size": n, "dtype": plan.dtype, **stats_ms(mm), "tflop_per_s": round(peak / 1e12, 1)}
    run.ceilings = {"copy_bytes_per_s": bw, "flop_per_s": peak}


def copy_times(nbytes: int, dev: str) -> list[float]:
    src = torch.full((nbytes,), 7, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return timed_s(lambda: dst.copy_(src), dev, repeat=10)


def device_facts(dev: str) -> dict:
    facts = {"torch": torch.__version__}
    for name in ("triton", "transformers"):
        try:
            facts[name] = __import__(name).__version__
        except ImportError:
            facts[name] = "not installed"
    if dev == "cuda":
        p = torch.cuda.get_device_properties(0)
        facts.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / GIB, 1), sms=p.multi_processor_count,
                     cuda=torch.version.cuda)
    else:
        facts.update(gpu="none (CPU smoke run)", cpu_threads=torch.get_num_threads())
    return facts


def section_llama(run: Run, row: dict) -> None:
    plan = run.plan
    path = llama_checkpoint(run)
    row["checkpoint"] = run.report["llama_checkpoint"]
    llm = start_engine(path, llama_engine_args(plan), row)
    try:
        runner = llm.engine.runner
        fill_kv_random(runner)
        w = weight_figures(runner.model)
        row["weights_gb"] = round(w["read_bytes"] / 1e9, 3)
        row["kv_kib_per_token"] = round(w["kv_token_bytes"] / 1024, 1)
        row["floor"] = ("(weights read per step, the input embedding's B rows only, + B x C x KV bytes per token) "
                        "/ the measured copy bandwidth" if run.ceilings else "no ceilings: no floor")
        row["decode"] = {}
        decode_grid(run, runner, w, [(b, c) for c in plan.contexts for b in plan.batches], row["decode"], "llama")
        row["prefill"] = {}
        peak = run.ceilings.get("flop_per_s")
        for tokens in plan.prefill:
            if run.left() < 5:
                row["prefill"][f"T{tokens}"] = {"skipped": "out of time"}
                continue
            times = prefill_run(runner, tokens, plan.prefill_reps, np.random.default_rng(3), f"prefill{tokens}")
            s = stats_ms(times)
            flops = prefill_flops(w, runner.model.args, tokens)
            entry = row["prefill"][f"T{tokens}"] = {**s, "tok_s": round(tokens / (s["median_ms"] / 1e3), 1),
                                                    "tflop_per_s": round(flops / (s["median_ms"] / 1e3) / 1e12, 1)}
            if peak:
                entry["share_of_peak"] = round(flops / (s["median_ms"] / 1e3) / peak, 3)
            run.save()
        row["busy"] = {}
        for batch, context in plan.busy:
            for mode in modes(runner):
                if run.left() < 5:
                    row["busy"][f"B{batch} C{context} {mode}"] = {"skipped": "out of time"}
                    continue
                with graphs_enabled(runner, mode == "graphs"):
                    row["busy"][f"B{batch} C{context} {mode}"] = busy_share(runner, batch, context, plan,
                                                                            f"busy-{mode}-{batch}")
                run.save()
        if run.left() < 10:
            row["offline_generate"] = {"skipped": "out of time"}
        else:
            run.offline = row["offline_generate"] = offline_run(llm, plan)
            loop = getattr(llm.engine.core, "loop", None)
            if loop is not None and run.left() > 10:  # the same, each step queued behind the one before
                loop.ahead = True
                row["offline_generate_async"] = offline_run(llm, plan)
                loop.ahead = False
        row["targets"] = llama_targets(row, plan)
    finally:
        llm.close()
        del llm


def llama_targets(row: dict, plan: Plan) -> dict:
    """The issue's targets, at context 1k (graphs where there are)."""
    c = min(plan.contexts)
    out = {}

    def best(key):
        e = row["decode"].get(key, {})
        return e.get("graphs") or e.get("eager") or {}

    b1 = best(f"B1 C{c}").get("itl_over_floor")
    out[f"B1 C{c} ITL <= 1.3x floor"] = None if b1 is None else {"value": b1, "met": b1 <= 1.3}
    for b in (64, 256):
        share = best(f"B{b} C{c}").get("tput_share_of_floor")
        out[f"B{b} C{c} throughput >= 0.7x floor"] = None if share is None else {"value": share, "met": share >= 0.7}
    pre = row["prefill"].get(f"T{max(plan.prefill)}", {}).get("share_of_peak")
    out[f"prefill {max(plan.prefill)} >= 50% of peak"] = None if pre is None else {"value": pre, "met": pre >= 0.5}
    return out


def section_transformers(run: Run, row: dict) -> None:
    import transformers

    plan, dev = run.plan, run.plan.device
    path = llama_checkpoint(run)
    dtype = getattr(torch, plan.dtype)
    t0 = time.perf_counter()
    place = {"device_map": "cuda"} if dev == "cuda" else {}
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **place)
    except TypeError:  # transformers before 4.56 names it torch_dtype
        model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype, **place)
    model.eval()
    row["load_s"] = round(time.perf_counter() - t0, 1)
    row["transformers"] = transformers.__version__
    row["attention"] = getattr(model.config, "_attn_implementation", "?")
    row["itl"] = f"(time for N + 1 new tokens - time for 1) / N, N = {plan.hf_new}, greedy, static cache"
    try:
        hf_decode(run, row, model)
        hf_prefill(run, row, model)
    finally:
        del model
        free_memory()


def hf_generate(model, ids: torch.Tensor, n: int, switch: dict) -> float:
    """Seconds for transformers to make n new tokens after ids (greedy, static cache)."""
    dev = ids.device.type
    sync(dev)
    t = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         cache_implementation="static", max_new_tokens=n, min_new_tokens=n,
                         pad_token_id=model.config.pad_token_id, **switch)
    sync(dev)
    if out.shape[1] - ids.shape[1] != n:
        raise RuntimeError(f"transformers made {out.shape[1] - ids.shape[1]} tokens, not {n}")
    return time.perf_counter() - t


def hf_decode(run: Run, row: dict, model) -> None:
    """ITL at each batch of hf_batches, beside Baton's at the same batch and context."""
    plan, dev = run.plan, run.plan.device
    gen = torch.Generator(dev).manual_seed(4)
    switch = {"disable_compile": True}  # generate's compile switch (on a GPU it compiles a static cache's step)
    row["compiled"] = "not compiled (--hf-compile off)"
    for batch in plan.hf_batches:
        ids = torch.randint(FIRST_ID, model.config.vocab_size, (batch, plan.hf_prompt), device=dev, generator=gen)
        if run.args.hf_compile and batch == plan.hf_batches[0]:
            switch = try_compile(run, row, model, ids, plan.hf_new)
        else:  # warm-up, at both cache lengths
            hf_generate(model, ids, 1, switch)
            hf_generate(model, ids, plan.hf_new + 1, switch)
        one, many = hf_generate(model, ids, 1, switch), hf_generate(model, ids, plan.hf_new + 1, switch)
        itl = (many - one) / plan.hf_new
        entry = row[f"B{batch} C{plan.hf_prompt}"] = {"itl_ms": round(itl * 1e3, 3), "tok_s": round(batch / itl, 1)}
        baton = run.report["sections"].get("llama8b", {}).get("decode", {}).get(f"B{batch} C{plan.hf_prompt}", {})
        for mode in ("graphs", "eager"):
            if "median_ms" in baton.get(mode, {}):
                entry[f"baton_{mode}_itl_ms"] = baton[mode]["median_ms"]
                entry[f"baton_{mode}_speedup"] = round(itl * 1e3 / baton[mode]["median_ms"], 2)
        run.save()


def hf_prefill(run: Run, row: dict, model) -> None:
    """One prompt of each prefill length through generate(max_new_tokens=1): the prompt's
    forward and one token, beside Baton's one-step prefill of the same length."""
    plan, dev = run.plan, run.plan.device
    gen = torch.Generator(dev).manual_seed(5)
    row["prefill"] = {}
    for tokens in plan.prefill:
        if run.left() < 10:
            row["prefill"][f"T{tokens}"] = {"skipped": "out of time"}
            continue
        ids = torch.randint(FIRST_ID, model.config.vocab_size, (1, tokens), device=dev, generator=gen)
        switch = {"disable_compile": True}
        hf_generate(model, ids, 1, switch)  # warm-up
        took = min(hf_generate(model, ids, 1, switch) for _ in range(2))
        entry = row["prefill"][f"T{tokens}"] = {"ms": round(took * 1e3, 3), "tok_s": round(tokens / took, 1)}
        baton = run.report["sections"].get("llama8b", {}).get("prefill", {}).get(f"T{tokens}", {})
        if "median_ms" in baton:
            entry["baton_ms"] = baton["median_ms"]
            entry["baton_speedup"] = round(took * 1e3 / baton["median_ms"], 2)
        run.save()


def try_compile(run: Run, row: dict, model, ids: torch.Tensor, n: int) -> dict:
    """transformers' own compile of the decode step (generate compiles it with a static cache on
    a GPU), within --hf-compile-cap seconds; eager past that. Returns generate's compile switch."""
    t0 = time.perf_counter()
    try:
        with run.time_cap(run.args.hf_compile_cap):
            hf_generate(model, ids, 1, {})
            hf_generate(model, ids, n + 1, {})
        row["compiled"] = f"compiled by generate in {time.perf_counter() - t0:.0f} s"
        return {}
    except OutOfTime:
        if time.monotonic() >= run.alarm_at - 1:  # the section's own alarm, not the cap's
            raise
        row["compiled"] = f"not compiled: past the {run.args.hf_compile_cap:g} s cap, eager instead"
        return {"disable_compile": True}


def section_moe(run: Run, row: dict) -> None:
    plan, layers = run.plan, run.args.moe_layers
    row["layers"] = (f"{layers} of Qwen3-30B-A3B's {QWEN3_30B_A3B_LAYERS}" if plan.moe_shape is QWEN3_30B_A3B
                     else f"{layers} (tiny shape)")
    folder = run.scratch_dir(moe_bytes(plan.moe_shape, layers))
    t0 = time.perf_counter()
    row["checkpoint"] = write_moe_checkpoint(folder, plan.moe_shape, layers, plan.device)
    row["checkpoint"]["write_s"] = round(time.perf_counter() - t0, 1)
    run.save()
    llm = None
    try:
        llm = start_engine(folder, engine_args(plan, plan.moe_context + 256, max(plan.moe_batches), 2048,
                                               plan.moe_batches), row)
        runner = llm.engine.runner
        fill_kv_random(runner)
        w = weight_figures(runner.model)
        row["weights_gb"] = round(w["read_bytes"] / 1e9, 3)
        row["floor"] = ("active bytes per step over the measured copy bandwidth: every weight but the input "
                        "embedding (attention, routers, norms, lm_head) and, per layer, E (1 - (1 - k/E)^B) of its "
                        "E experts (the distinct experts B tokens of top-k routing hit if routing were uniform), "
                        "+ B x C x KV bytes per token")
        row["decode"] = {}
        decode_grid(run, runner, w, [(b, plan.moe_context) for b in plan.moe_batches], row["decode"], "moe", moe=True)
        e, k = w["num_experts"], w["top_k"]
        for b in plan.moe_batches:
            if e and f"B{b} C{plan.moe_context}" in row["decode"]:
                row["decode"][f"B{b} C{plan.moe_context}"]["experts_hit_per_layer"] = round(e * (1 - (1 - k / e) ** b),
                                                                                            1)
    finally:
        if llm is not None:
            llm.close()
        del llm
        free_memory()
        shutil.rmtree(folder, ignore_errors=True)
