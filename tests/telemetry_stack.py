"""Readers of the services' /metrics pages, for the telemetry tests (whose stack is the
`traced_stack` fixture in conftest.py)."""
from __future__ import annotations

import asyncio
import urllib.parse
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from servers import ServerProcess


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def metrics_url(proc: ServerProcess) -> str:
    proc.address  # noqa: B018 - waits until it serves (the metrics line comes first)
    return next(line.split()[2] for line in proc.lines if line.startswith("metrics on "))


def scrape(url: str, openmetrics: bool = False) -> str:
    accept = "application/openmetrics-text; version=1.0.0" if openmetrics else "text/plain"
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Accept": accept}), timeout=10) as resp:
        return resp.read().decode()


def samples(url: str) -> dict[tuple, float]:
    """(sample name, sorted labels without model_name/role) -> value, through the Prometheus parser."""
    out = {}
    for family in text_string_to_metric_families(scrape(url)):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "role")))
            out[(s.name, labels)] = s.value
    return out
