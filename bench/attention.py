"""The Triton paged-attention kernels against torch SDPA, side by side in one run (on a GPU).

Decode: one query token per sequence, Llama-3-8B's heads (32 query, 8 KV, 128 wide), bf16,
block size 16, batch 1-256 × context 512-32k. Each shape runs three ways over the same K/V:
  - baton: the paged decode kernel, reading the blocks in place through the block table;
  - sdpa: torch SDPA on the K/V laid out contiguously (the practical ceiling);
  - gather+sdpa: the blocks gathered into contiguous K/V first, then SDPA (what a paged cache
    costs without a paged kernel).
Figures: time, achieved bandwidth (K and V bytes read / time) as % of the device's peak, and
baton's speed relative to each. Prefill: 8 × 2k causal, TFLOP/s against SDPA causal on
contiguous tensors. Every kernel's output is checked against SDPA's before it is timed.

    python bench/attention.py                 # on a GPU
    python bench/attention.py --smoke         # tiny shapes on CPU under Triton's interpreter:
                                              # checks the bench runs; its times mean nothing
"""
from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.nn.functional as F

PEAK_TBPS = {"H100": 3.35, "H200": 4.8, "A100": 2.0}  # HBM bandwidth by device name


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", default="1,8,64,256", help="decode batch sizes (comma list)")
    p.add_argument("--context", default="512,4096,32768", help="decode context lengths (comma list)")
    p.add_argument("--max-tokens", type=int, default=1 << 21, help="skip shapes holding more tokens (memory)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--peak-tbps", type=float, help="the device's memory bandwidth (default: by its name)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under Triton's interpreter")
    args = p.parse_args(argv)
    args.batch = [int(b) for b in args.batch.split(",")]
    args.context = [int(c) for c in args.context.split(",")]
    return args


def timed(fn, iters: int, device: torch.device) -> float:
    """Median seconds per call, after warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def paged_case(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype, device,
               seed: int = 0):
    """Contiguous K/V [B, Hkv, L, D] and the same values in a paged cache whose blocks are
    shuffled as a pool hands them out; q [B, Hq, D]."""
    gen = torch.Generator(device).manual_seed(seed)
    blocks_per_seq = math.ceil(context / block_size)
    k = torch.randn(batch, kv_heads, blocks_per_seq * block_size, head_dim, generator=gen, device=device).to(dtype)
    v = torch.randn(k.shape, generator=gen, device=device).to(dtype)
    q = torch.randn(batch, heads, head_dim, generator=gen, device=device).to(dtype)
    num_blocks = batch * blocks_per_seq
    tables = torch.randperm(num_blocks, generator=gen, device=device).view(batch, blocks_per_seq).to(torch.int32)
    k_cache = torch.empty(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.empty_like(k_cache)
    # [B, Hkv, nblk, bs, D] -> [B * nblk, bs, Hkv, D], scattered to the table's block ids.
    k_cache[tables.flatten().long()] = k.view(batch, kv_heads, blocks_per_seq, block_size, head_dim).permute(
        0, 2, 3, 1, 4).reshape(num_blocks, block_size, kv_heads, head_dim)
    v_cache[tables.flatten().long()] = v.view(batch, kv_heads, blocks_per_seq, block_size, head_dim).permute(
        0, 2, 3, 1, 4).reshape(num_blocks, block_size, kv_heads, head_dim)
    k, v = k[:, :, :context], v[:, :, :context]
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return q, k, v, k_cache, v_cache, tables, seq_lens


def sdpa_decode(q, k, v, scale):
    return F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)[:, :, 0]


def gather_sdpa_decode(q, k_cache, v_cache, tables, context, scale):
    batch, kv_heads = tables.shape[0], k_cache.shape[2]
    k = k_cache.index_select(0, tables.flatten().long()).view(batch, -1, kv_heads, k_cache.shape[-1])
    v = v_cache.index_select(0, tables.flatten().long()).view(batch, -1, kv_heads, v_cache.shape[-1])
    return sdpa_decode(q, k[:, :context].transpose(1, 2), v[:, :context].transpose(1, 2), scale)


def decode_row(args, batch, context, heads, kv_heads, head_dim, dtype, device, peak_bps, tol) -> list[str]:
    """One shape's figures (its tensors freed on return, before the next shape's)."""
    from baton.kernels.triton_attention import paged_decode_attention

    scale = head_dim ** -0.5
    q, k, v, k_cache, v_cache, tables, seq_lens = paged_case(batch, context, heads, kv_heads, head_dim,
                                                             args.block_size, dtype, device)
    want = sdpa_decode(q, k, v, scale)
    got = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    gathered = gather_sdpa_decode(q, k_cache, v_cache, tables, context, scale)
    torch.testing.assert_close(gathered.float(), want.float(), atol=tol, rtol=tol)
    t_ours = timed(lambda: paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale), args.iters, device)
    t_sdpa = timed(lambda: sdpa_decode(q, k, v, scale), args.iters, device)
    t_gather = timed(lambda: gather_sdpa_decode(q, k_cache, v_cache, tables, context, scale), args.iters, device)
    moved = 2 * k.numel() * k.element_size()  # K and V, read once

    def pct(t):
        return f"{100 * moved / t / peak_bps:.1f}%"
    return [str(batch), str(context), f"{t_ours * 1e3:.3f}", pct(t_ours), f"{t_sdpa * 1e3:.3f}", pct(t_sdpa),
            f"{t_sdpa / t_ours:.2f}x", f"{t_gather * 1e3:.3f}", pct(t_gather), f"{t_gather / t_ours:.2f}x"]


def bench_decode(args, heads, kv_heads, head_dim, dtype, device, peak_bps, tol) -> None:
    print(f"\ndecode: {heads} query / {kv_heads} KV heads × {head_dim}, {dtype}, block {args.block_size}; "
          f"% of peak {peak_bps / 1e12:.2f} TB/s; baton's speed vs each (>1: baton faster)")
    header = ["batch", "context", "baton ms", "baton %peak", "sdpa ms", "sdpa %peak", "vs sdpa", "gather+sdpa ms",
              "gather %peak", "vs gather"]
    rows = [header]
    for batch in args.batch:
        for context in args.context:
            if batch * context <= args.max_tokens:
                rows.append(decode_row(args, batch, context, heads, kv_heads, head_dim, dtype, device, peak_bps, tol))
    print_rows(rows)


def bench_prefill(args, batch, context, heads, kv_heads, head_dim, dtype, device, tol) -> None:
    from baton.kernels.triton_attention import paged_prefill_attention

    scale = head_dim ** -0.5
    _, k, v, k_cache, v_cache, tables, seq_lens = paged_case(batch, context, heads, kv_heads, head_dim,
                                                             args.block_size, dtype, device, seed=1)
    q = torch.randn(batch, heads, context, head_dim, device=device).to(dtype)
    q_rows = q.permute(0, 2, 1, 3).reshape(batch * context, heads, head_dim)  # the engine's flat rows
    q_lens = seq_lens.clone()
    q_starts = torch.arange(batch, dtype=torch.int32, device=device) * context

    def ours():
        return paged_prefill_attention(q_rows, k_cache, v_cache, tables, q_starts, q_lens, seq_lens, scale,
                                       max_q_len=context)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    torch.testing.assert_close(ours().view(batch, context, heads, head_dim).float(),
                               sdpa().permute(0, 2, 1, 3).float(), atol=tol, rtol=tol)
    flops = 4 * batch * heads * head_dim * context * context / 2  # QK^T and PV, causal: half the square
    t_ours, t_sdpa = timed(ours, max(3, args.iters // 5), device), timed(sdpa, max(3, args.iters // 5), device)
    print(f"\nprefill: {batch} × {context} causal, {heads}/{kv_heads} heads × {head_dim}, {dtype}")
    print_rows([["kernel", "ms", "TFLOP/s"],
                ["baton (paged)", f"{t_ours * 1e3:.3f}", f"{flops / t_ours / 1e12:.1f}"],
                ["sdpa causal (contiguous)", f"{t_sdpa * 1e3:.3f}", f"{flops / t_sdpa / 1e12:.1f}"],
                ["baton vs sdpa", f"{t_sdpa / t_ours:.2f}x", ""]])


def print_rows(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    print("\n".join(lines))


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
        args.batch, args.context, args.iters = [2], [40], 2
        device, dtype, tol = torch.device("cpu"), torch.float32, 2e-5
        heads, kv_heads, head_dim, prefill = 4, 2, 64, (2, 24)
        peak = args.peak_tbps or 0.1
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench/attention.py needs a CUDA device (or --smoke, to check it runs on CPU)")
        device, dtype, tol = torch.device("cuda"), torch.bfloat16, 1.6e-2
        heads, kv_heads, head_dim, prefill = 32, 8, 128, (8, 2048)
        name = torch.cuda.get_device_name(device)
        peak = args.peak_tbps or next((v for k, v in PEAK_TBPS.items() if k in name), None)
        if peak is None:
            raise SystemExit(f"unknown peak bandwidth for {name}: pass --peak-tbps")
        print(f"{name}, torch {torch.__version__}")
    import triton
    print(f"triton {triton.__version__}{' (interpreter)' if os.environ.get('TRITON_INTERPRET') == '1' else ''}")
    bench_decode(args, heads, kv_heads, head_dim, dtype, device, peak * 1e12, tol)
    bench_prefill(args, *prefill, heads, kv_heads, head_dim, dtype, device, tol)


if __name__ == "__main__":
    main()
