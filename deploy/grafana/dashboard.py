"""Writes baton-dashboard.json, the Grafana dashboard for Baton's Prometheus metrics, from the
panel list below: `python deploy/grafana/dashboard.py` (a test fails when the JSON is stale).

Import the JSON as is (Dashboards -> New -> Import) and pick a Prometheus data source. The
P/D rows show what a disaggregated stack adds: the router's breakdown of the time to first
token, handoff latency, KV transfer bandwidth and outcomes, held blocks, and each tier's
queue.
"""
from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).with_name("baton-dashboard.json")
SEL = 'model_name=~"$model"'  # every query's label filter
RATE = "[$__rate_interval]"


def q(quantile: float, metric: str, by: str = "", where: str = "") -> str:
    group = f"le{', ' + by if by else ''}"
    return (f"histogram_quantile({quantile}, sum by ({group}) "
            f"(rate({metric}_bucket{{{SEL}{', ' + where if where else ''}}}{RATE})))")


def rate(metric: str, by: str, where: str = "") -> str:
    return f"sum by ({by}) (rate({metric}{{{SEL}{', ' + where if where else ''}}}{RATE}))"


# (row title, [(panel title, unit, [(expr, legend)], description)])
ROWS = [
    ("Requests", [
        ("Finished requests per second", "reqps", [(rate("baton:request_success_total", "role, finished_reason"),
                                                    "{{role}} {{finished_reason}}")],
         "Requests that ended, by tier and finish reason (the router counts what clients saw)."),
        ("Failed requests per second", "reqps", [(rate("baton:router_request_errors_total", "code"), "{{code}}")],
         "Requests the router ended with an error, by gRPC code."),
        ("Time to first token (client view)", "s", [
            (q(0.5, "baton:time_to_first_token_seconds", where='role="router"'), "p50"),
            (q(0.99, "baton:time_to_first_token_seconds", where='role="router"'), "p99")],
         "From the request reaching the router to the first token leaving it."),
        ("End-to-end latency", "s", [(q(0.5, "baton:e2e_request_latency_seconds", "role"), "p50 {{role}}"),
                                      (q(0.99, "baton:e2e_request_latency_seconds", "role"), "p99 {{role}}")], ""),
        ("Inter-token latency", "s", [(q(0.5, "baton:inter_token_latency_seconds", "role"), "p50 {{role}}"),
                                      (q(0.99, "baton:inter_token_latency_seconds", "role"), "p99 {{role}}")],
         "Gaps between a request's tokens on the engine that samples them."),
        ("Tokens per second", "short", [(rate("baton:prompt_tokens_total", "role"), "prompt {{role}}"),
                                        (rate("baton:generation_tokens_total", "role"), "generated {{role}}")], ""),
    ]),
    ("Prefill / decode handoff", [
        ("Time to first token, broken down (p50)", "s", [
            (q(0.5, "baton:router_prefill_leg_seconds"), "prefill leg"),
            (q(0.5, "baton:router_handoff_seconds"), "handoff"),
            (q(0.5, "baton:router_first_decode_step_seconds"), "first decode step")],
         "Prefill leg: the Prefill call (its reply is the first token). Handoff: from there until the decode could "
         "run the request (call, handshake, KV pull, a step's wait). First decode step: KV landed to its first token."),
        ("Handoff latency", "s", [(q(0.5, "baton:router_handoff_seconds"), "p50"),
                                  (q(0.9, "baton:router_handoff_seconds"), "p90"),
                                  (q(0.99, "baton:router_handoff_seconds"), "p99")], ""),
        ("KV transfer time", "s", [(q(0.5, "baton:nixl_xfer_time_seconds"), "p50"),
                                   (q(0.99, "baton:nixl_xfer_time_seconds"), "p99")],
         "One pull of a request's blocks (NIXL READ), on the decode."),
        ("KV transfer bandwidth per prefill peer", "Bps", [(
            f"{rate('baton:kv_transfer_peer_bytes_total', 'instance, peer')} / "
            f"{rate('baton:kv_transfer_peer_seconds_total', 'instance, peer')}", "{{instance}} <- {{peer}}")], ""),
        ("KV transfer outcomes", "ops", [(rate("baton:kv_transfer_outcomes_total", "outcome"), "{{outcome}}"),
                                          (rate("baton:kv_recomputed_tokens_total", "role"), "recomputed tokens/s")],
         "ok: every block arrived; recomputed: a failed read, the decode recomputed from the first bad block; "
         "failed: the prefill could not be reached."),
        ("Held KV blocks (prefill)", "short", [
            (f'sum by (instance) (baton:kv_held_blocks{{{SEL}, role="prefill"}})', "{{instance}}"),
            (rate("baton:kv_hold_outcomes_total", "outcome"), "ended: {{outcome}}/s")],
         "Blocks a prefill holds until a decode pulls them; expired holds were never pulled."),
    ]),
    ("Queues and load, per tier", [
        ("Waiting requests by reason", "short", [
            (f"sum by (role, reason) (baton:num_requests_waiting_by_reason{{{SEL}}})", "{{role}} {{reason}}")],
         "capacity: waiting for room; remote_kvs: WAITING_FOR_REMOTE_KVS, their KV being pulled."),
        ("Running requests", "short", [(f"sum by (role) (baton:num_requests_running{{{SEL}}})", "{{role}}")], ""),
        ("Queue time", "s", [(q(0.5, "baton:request_queue_time_seconds", "role"), "p50 {{role}}"),
                             (q(0.99, "baton:request_queue_time_seconds", "role"), "p99 {{role}}")], ""),
        ("KV cache usage", "percentunit", [(f"baton:kv_cache_usage_perc{{{SEL}}}", "{{role}} {{instance}}")], ""),
        ("Prefix cache hit rate", "percentunit", [(
            f"{rate('baton:prefix_cache_hits_total', 'role')} / {rate('baton:prefix_cache_queries_total', 'role')}",
            "{{role}}")], ""),
        ("Preemptions per second", "ops", [(rate("baton:num_preemptions_total", "role"), "{{role}}")], ""),
        ("Router: fallbacks and retries", "ops", [
            (rate("baton:router_colocated_fallbacks_total", "reason"), "colocated: {{reason}}"),
            (rate("baton:router_retries_total", "tier"), "retry {{tier}}"),
            (rate("baton:router_backend_errors_total", "tier, code"), "error {{tier}} {{code}}")], ""),
        ("Router: policy decisions", "ops", [(rate("baton:router_policy_decisions_total", "tier, decision"),
                                              "{{tier}} {{decision}}")], ""),
    ]),
    ("Host KV tier, LoRA adapters, structured output", [
        ("Host KV tier usage", "percentunit", [(f"baton:host_kv_cache_usage_perc{{{SEL}}}", "{{role}} {{instance}}")],
         "kv_offloading_size: the share of the host tier holding a block's copy, a swapped or an in-flight block."),
        ("Host KV tier traffic", "ops", [
            (rate("baton:host_kv_transferred_blocks_total", "direction"), "blocks {{direction}}/s"),
            (rate("baton:host_kv_cache_hits_total", "role"), "hit tokens/s {{role}}")],
         "Blocks written back to the host tier and brought back; prompt tokens loaded from it instead of recomputed."),
        ("Swaps and hand-offs", "short", [
            (rate("baton:num_swap_preemptions_total", "role"), "swapped out/s {{role}}"),
            (f"sum by (role) (baton:num_requests_swapped{{{SEL}}})", "waiting swapped {{role}}"),
            (rate("baton:kv_host_hand_offs_total", "role"), "holds handed off/s {{role}}")],
         "Preemptions that swapped to the host tier, requests waiting swapped, and prefill holds moved "
         "to the host tier because the device pool was short."),
        ("LoRA adapters", "short", [
            (f"sum by (role, state) (baton:lora_adapters{{{SEL}}})", "{{state}} {{role}}"),
            (rate("baton:lora_device_loads_total", "role"), "device loads/s {{role}}")],
         "Loaded adapters, those running (at most max_loras), and adapters put on the device."),
        ("Constrained requests", "reqps", [(rate("baton:structured_output_requests_total", "kind"), "{{kind}}")],
         "Requests under a structured output constraint, by kind."),
        ("Grammar wait", "s", [(q(0.5, "baton:grammar_wait_seconds"), "p50"),
                               (q(0.99, "baton:grammar_wait_seconds"), "p99")],
         "From a constrained request's arrival until its grammar was ready (compiled off the step loop)."),
    ]),
    ("Speculative decoding", [
        ("Draft acceptance", "percentunit", [
            (f"{rate('baton:spec_decode_num_accepted_tokens_total', 'role')} / "
             f"{rate('baton:spec_decode_num_draft_tokens_total', 'role')}", "accepted / drafted {{role}}")],
         "The share of drafted tokens the target model kept (--speculative-config)."),
        ("Tokens per verified draft", "short", [
            (f"1 + {rate('baton:spec_decode_num_accepted_tokens_total', 'role')} / "
             f"{rate('baton:spec_decode_num_drafts_total', 'role')}", "tokens per step {{role}}")],
         "Tokens a request gets from one step that verifies its drafts: the kept drafts and one more."),
        ("Acceptance by draft position", "percentunit", [
            (f"{rate('baton:spec_decode_num_accepted_tokens_per_pos_total', 'role, position')} / ignoring(position) "
             f"group_left {rate('baton:spec_decode_num_drafts_total', 'role')}", "position {{position}} {{role}}")],
         "The share of verified drafts whose token at each position was kept (position 0: the first after the "
         "request's last token)."),
    ]),
]


def dashboard() -> dict:
    panels, y, next_id = [], 0, 1
    source = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    for row_title, row in ROWS:
        panels.append({"id": next_id, "type": "row", "title": row_title, "collapsed": False, "panels": [],
                       "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}})
        next_id, y = next_id + 1, y + 1
        for i, (title, unit, queries, description) in enumerate(row):
            panels.append({
                "id": next_id, "type": "timeseries", "title": title, "description": description,
                "datasource": source, "gridPos": {"x": (i % 3) * 8, "y": y + (i // 3) * 8, "w": 8, "h": 8},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
                "targets": [{"refId": chr(ord("A") + k), "datasource": source, "expr": expr, "legendFormat": legend}
                            for k, (expr, legend) in enumerate(queries)]})
            next_id += 1
        y += 8 * -(-len(row) // 3)
    return {
        "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource", "pluginId": "prometheus",
                      "pluginName": "Prometheus"}],
        "__requires": [{"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.0.0"},
                       {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
                       {"type": "panel", "id": "timeseries", "name": "Time series", "version": ""}],
        "title": "Baton", "uid": "baton-pd", "description": "Baton: disaggregated prefill and decode serving",
        "tags": ["baton", "llm"], "editable": True, "schemaVersion": 39, "version": 1, "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": [{
            "name": "model", "label": "model", "type": "query", "datasource": source,
            "query": {"query": "label_values(baton:num_requests_running, model_name)", "refId": "model"},
            "definition": "label_values(baton:num_requests_running, model_name)", "includeAll": True,
            "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"}, "refresh": 2}]},
        "panels": panels}


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
