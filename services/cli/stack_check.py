"""`baton check-stack`: one request through a running stack, then proof from each tier's
metrics that it did its part: the decodes pulled KV blocks and a prefill's hold was pulled.
A disaggregated stack that silently decodes everything itself fails it. Helm's test hook
runs it; it needs no torch."""
from __future__ import annotations

import socket
import sys
import time
import urllib.request

import grpc
from prometheus_client.parser import text_string_to_metric_families

from baton.services.cli.tls_flags import tls_config
from baton.services.client import Client
from baton.services.router.backends import addresses, split_host_port
from baton.services.rpc.tls import TLSConfig

# Several blocks of prompt, so there is KV to move whatever the block size.
PROMPT = ("Disaggregated serving runs the prompt on one set of machines and the decoding on another, "
          "so that long prompts do not stall the tokens of running streams. Summarise this in one line.")
PULLS = ("baton:kv_transfer_outcomes_total", {"outcome": "ok"})  # on a decode
PULLED_BYTES = ("baton:kv_transfer_peer_bytes_total", {})  # on a decode, summed over peers
HOLDS_PULLED = ("baton:kv_hold_outcomes_total", {"outcome": "pulled"})  # on a prefill


def endpoints(specs: list[str]) -> list[str]:
    """HOST:PORT each, a DNS name standing for every address it resolves to (a headless
    Service's pods)."""
    found: list[str] = []
    for spec in specs:
        host, port = split_host_port(spec)
        found += addresses(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM), port)
    return list(dict.fromkeys(found))


def scrape(address: str, timeout_s: float = 5.0) -> dict[tuple, float]:
    """Every sample of the /metrics page at address, by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: dict[tuple, float], metric: tuple[str, dict]) -> float:
    name, match = metric
    return sum(v for (n, labels), v in samples.items()
               if n == name and all(dict(labels).get(k) == want for k, want in match.items()))


def counts(prefills: list[str], decodes: list[str]) -> list[float]:
    """The decodes' KV pulls and bytes pulled, and the prefills' holds pulled: one scrape each."""
    pages = [scrape(a) for a in decodes]
    return [sum(total(p, PULLS) for p in pages), sum(total(p, PULLED_BYTES) for p in pages),
            sum(total(scrape(a), HOLDS_PULLED) for a in prefills)]


def generate_once(target: str, tls: TLSConfig | None, deadline: float) -> tuple[int, str]:
    """Token count and finish reason of one greedy request, retried while the stack is not
    ready yet (UNAVAILABLE) until the deadline."""
    with Client(target, tls=tls) as client:
        while True:
            try:
                n, finish = 0, ""
                for chunk in client.generate(PROMPT, max_tokens=8, temperature=0.0,
                                             timeout=max(1.0, deadline - time.monotonic())):
                    n += len(chunk.token_ids)
                    finish = chunk.finish_reason or finish
                return n, finish
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(1.0)


def check_stack(args) -> int:
    deadline = time.monotonic() + args.timeout
    tls = tls_config(args)
    try:
        prefills, decodes = endpoints(args.prefill_metrics), endpoints(args.decode_metrics)
        before = counts(prefills, decodes)
        n, finish = generate_once(args.target, tls, deadline)
    except (OSError, ValueError, grpc.RpcError) as e:
        detail = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else str(e)
        print(f"check-stack: FAILED: {detail}", file=sys.stderr)
        return 1
    print(f"check-stack: {args.target} streamed {n} tokens (finish={finish})")
    if n == 0 or not finish:
        print("check-stack: FAILED: the stream ended without tokens or a finish reason", file=sys.stderr)
        return 1
    if not prefills:
        return 0
    # The decode counts its pull when the blocks land, the prefill its hold when the decode's
    # notification arrives: wait a little for both.
    while True:
        after = counts(prefills, decodes)
        pulls, moved, holds = (a - b for a, b in zip(after, before))
        if (pulls >= 1 and moved > 0 and holds >= 1) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    print(f"check-stack: decodes pulled KV {pulls:g} time(s), {moved:g} bytes, from {len(prefills)} prefill(s) "
          f"whose holds were pulled {holds:g} time(s)")
    if pulls < 1 or moved <= 0 or holds < 1:
        print("check-stack: FAILED: no KV blocks moved from prefill to decode: the stack is decoding prompts "
              "itself (is the router given its prefill instances? are they healthy?)", file=sys.stderr)
        return 1
    return 0
