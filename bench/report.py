"""The serving benchmarks' figures: vLLM's `bench serve` metrics from per-request traces, and
the side-by-side table with ratios to a baseline (bench/serve.py, bench/peer_serve.py)."""
from __future__ import annotations

import numpy as np


def metrics(traces: list, wall: float, workload: list) -> dict[str, float]:
    """traces: serve.Trace per request of workload (serve.Request), over `wall` seconds."""
    ok = [(t, r) for t, r in zip(traces, workload) if t.ok and t.chunk_s]
    ttft = [t.chunk_s[0] - t.start_s for t, _ in ok]
    e2e = [t.chunk_s[-1] - t.start_s for t, _ in ok]
    tpot = [(t.chunk_s[-1] - t.chunk_s[0]) / (t.tokens - 1) for t, _ in ok if t.tokens > 1]
    itl = [b - a for t, _ in ok for a, b in zip(t.chunk_s, t.chunk_s[1:])]
    out = {"completed": len(ok), "request/s": len(ok) / wall, "output tok/s": sum(t.tokens for t, _ in ok) / wall,
           "total tok/s": sum(t.tokens + len(r.prompt) for t, r in ok) / wall}
    for name, xs in (("TTFT", ttft), ("TPOT", tpot), ("ITL", itl), ("E2E", e2e)):
        for q in (50, 90, 99):
            out[f"{name} p{q} ms"] = float(np.percentile(xs, q)) * 1e3 if xs else float("nan")
    return out


def measured(traces: list, wall: float, workload: list, start: dict[str, float], end: dict[str, float]) -> dict:
    """A service run's metrics, its messages per token and its processes' CPU per token (from
    their CPU seconds at the warm-up's end and at the run's: stack.cpu_mark's)."""
    row = metrics(traces, wall, workload)
    tokens = sum(t.tokens for t in traces if t.ok) or 1
    row["messages/tok"] = sum(len(t.chunk_s) for t in traces if t.ok) / tokens
    row.update({f"{who} CPU us/tok": float("nan") for who in ("router", "fronts", "decode front", "cores", "client")})
    row.update({f"{who} CPU us/tok": (s - start[who]) * 1e6 / tokens for who, s in end.items()})
    return row


def print_table(rows: dict[str, dict[str, float]], base: str | None) -> None:
    names = list(rows)
    keys = list(next(iter(rows.values())))
    ratios = [n for n in names if base and n != base]
    header = ["metric", *names, *(f"{n} / {base}" for n in ratios)]
    lines = [header]
    for k in keys:
        line = [k, *(f"{rows[n][k]:.2f}" for n in names)]
        line += [f"{rows[n][k] / rows[base][k]:.3f}" if rows[base][k] else "-" for n in ratios]
        lines.append(line)
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    text = [" | ".join(c.ljust(w) for c, w in zip(row, widths)) for row in lines]
    text.insert(1, "-+-".join("-" * w for w in widths))
    print("\n" + "\n".join(text))
