"""bench/gpu_perf.py's table: each section's key figures and ratios from the report (report.json
keeps the rest)."""
from __future__ import annotations


def summary_lines(report: dict) -> list[str]:
    """The compact table: per section its key figures and ratios (report.json has the rest)."""
    lines = []
    w = report.get("wheels") or {}
    if w.get("unpacked") or w.get("lacking_after"):
        lines.append(f"wheels unpacked from .whl: {len(w.get('unpacked', []))}; still lacking: "
                     f"{', '.join(w.get('lacking_after', [])) or 'nothing'}")
    s = report.get("sections", {})
    for name, fmt in (("ceilings", _fmt_ceilings), ("llama8b", _fmt_llama), ("transformers", _fmt_hf),
                      ("moe", _fmt_moe), ("serve", _fmt_serve)):
        row = s.get(name)
        if row is None:
            continue
        head = f"== {name}: " + ("skipped: " + row["skipped"] if "skipped" in row else
                                 f"{'ok' if row.get('ok') else 'FAILED' if 'ok' in row else 'running'}"
                                 f" ({row.get('seconds', '?')} s)")
        lines.append(head)
        if "skipped" in row:
            continue
        try:
            lines += fmt(row)
        except Exception as e:  # noqa: BLE001 - a table that cannot be formatted still leaves report.json
            lines.append(f"   (not formatted: {type(e).__name__}: {e})")
        if "cut" in row:
            lines.append("   " + row["cut"])
        if "error" in row:
            lines += ["   " + x for x in row["error"].strip().splitlines()[-6:]]
    lines.append(f"elapsed {report.get('elapsed_s', '?')} s of a {report.get('budget_s')} s budget; "
                 "every figure in report.json")
    return lines


def _fmt_ceilings(r: dict) -> list[str]:
    out = [f"   {r.get('gpu')} | torch {r.get('torch')} | triton {r.get('triton')} | "
           f"transformers {r.get('transformers')}"]
    if "copy" in r:
        out.append(f"   copy {r['copy']['tb_per_s']} TB/s (read + written) | "
                   f"{r.get('matmul', {}).get('dtype')} matmul {r.get('matmul', {}).get('tflop_per_s')} TFLOP/s")
    return out


def _decode_table(decode: dict) -> list[str]:
    out = [f"   {'decode':<12}{'graphs ITL ms':>14}{'p90':>8}{'tok/s':>9}{'xfloor':>8}"
           f"{'eager ITL ms':>14}{'tok/s':>9}{'xfloor':>8}{'floor ms':>10}"]
    for key, e in decode.items():
        if "skipped" in e:
            out.append(f"   {key:<12}{e['skipped']}")
            continue
        g, x = e.get("graphs", {}), e.get("eager", {})
        out.append(f"   {key:<12}{g.get('median_ms', '-'):>14}{g.get('p90_ms', '-'):>8}{g.get('tok_s', '-'):>9}"
                   f"{g.get('itl_over_floor', '-'):>8}{x.get('median_ms', '-'):>14}{x.get('tok_s', '-'):>9}"
                   f"{x.get('itl_over_floor', '-'):>8}{e.get('floor_ms', '-'):>10}")
    return out


def _fmt_llama(r: dict) -> list[str]:
    out = []
    ck, en = r.get("checkpoint", {}), r.get("engine")
    if ck:
        out.append(f"   checkpoint {ck.get('gib')} GiB written in {ck.get('write_s')} s" + (
            f" | engine start {en['start_s']} s, {en['num_kv_blocks']} KV blocks, graphs {en['graphs']}" if en else ""))
    out += _decode_table(r.get("decode", {}))
    for key, e in r.get("prefill", {}).items():
        if "skipped" in e:
            out.append(f"   prefill {key}: {e['skipped']}")
            continue
        out.append(f"   prefill {key}: {e['median_ms']} ms, {e['tok_s']:.0f} tok/s, {e['tflop_per_s']} TFLOP/s"
                   + (f" = {e['share_of_peak']:.0%} of peak" if "share_of_peak" in e else ""))
    for key, e in r.get("busy", {}).items():
        out.append(f"   busy {key}: " + (e["skipped"] if "skipped" in e else
                                         f"{e['busy_share']:.0%} of {e['step_ms']} ms/step, host overhead "
                                         f"{e['host_overhead_ms']} ms ({e['device_events']} device events)"))
    for key, label in (("offline_generate", "offline generate"), ("offline_generate_async", "  async scheduling")):
        o = r.get(key)
        if o and "skipped" in o:
            out.append(f"   {label}: {o['skipped']}")
        elif o:
            out.append(f"   {label} {o['requests']} x ({o['input_len']} in, {o['output_len']} out): "
                       f"{o['output_tok_s']} output tok/s in {o['seconds']} s, scheduler {o['scheduler_share']:.1%}")
    for key, t in (r.get("targets") or {}).items():
        out.append(f"   target {key}: " + ("no figure" if t is None else
                                           f"{t['value']} -> {'MET' if t['met'] else 'NOT MET'}"))
    return out


def _fmt_hf(r: dict) -> list[str]:
    out = [f"   transformers {r.get('transformers')}, {r.get('attention')} attention, {r.get('compiled')}, "
           f"load {r.get('load_s')} s"]
    for key, e in r.items():
        if key.startswith("B") and isinstance(e, dict):
            out.append(f"   {key}: ITL {e['itl_ms']} ms ({e['tok_s']} tok/s); Baton graphs "
                       f"{e.get('baton_graphs_itl_ms', '-')} ms = {e.get('baton_graphs_speedup', '-')}x faster, "
                       f"eager {e.get('baton_eager_itl_ms', '-')} ms = {e.get('baton_eager_speedup', '-')}x")
    for key, e in r.get("prefill", {}).items():
        out.append(f"   prefill {key}: " + (e["skipped"] if "skipped" in e else
                                            f"{e['ms']} ms ({e['tok_s']:.0f} tok/s); Baton {e.get('baton_ms', '-')} ms "
                                            f"= {e.get('baton_speedup', '-')}x faster"))
    return out


def _fmt_moe(r: dict) -> list[str]:
    ck, en = r.get("checkpoint", {}), r.get("engine", {})
    out = [f"   {r.get('layers')} layers | checkpoint {ck.get('gib')} GiB in {ck.get('write_s')} s | "
           f"engine start {en.get('start_s')} s, graphs {en.get('graphs')}"]
    return out + _decode_table(r.get("decode", {}))


def _fmt_serve(r: dict) -> list[str]:
    c = r.get("client")
    if not c:
        return [f"   server start {r.get('start_s', '-')} s"]
    ratio = r.get("server_over_offline")
    ratio = f"= {ratio} x offline" if isinstance(ratio, float) else f"({ratio})"
    return [f"   {c['requests']} x ({c['input_len']} in, {c['output_len']} out) over gRPC: {c['output_tok_s']} "
            f"output tok/s {ratio} | TTFT p50 {c['ttft'].get('median_ms')} ms "
            f"p90 {c['ttft'].get('p90_ms')} | ITL p50 {c['itl'].get('median_ms')} ms p90 {c['itl'].get('p90_ms')} | "
            f"TPOT p50 {c['tpot'].get('median_ms')} ms | server start {r.get('start_s')} s"]
