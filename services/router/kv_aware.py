"""The `kv_aware` policy: the instance whose prefix cache already holds most of the prompt,
weighed against its load, as Dynamo's KV router scores workers.

For each candidate i, from the router's KV index (kv_index.py) and its own ledger of what it
sent where (Backend.charge):
  D_i  the prompt's leading blocks i holds in device memory
  H_i  the blocks after those that i holds in host memory only (a load from host costs less
       than a recompute, not nothing: they count host_hit_weight of a device block)
  Q_i  prompt blocks routed to i that it has not computed yet (their first token has not come
       back): the prefill queue the request would wait behind
  A_i  blocks of the requests in flight at i (prompt blocks, whatever their state)
  P    the prompt's blocks (its full ones, and the partial last one)

  new prefill blocks    N_i = P - D_i - host_hit_weight * H_i
  score_i = -(overlap_score_weight * (Q_i + N_i) + A_i)

The instance with the highest score wins: fewest blocks to compute before this request's first
token (its own, less what the cache holds, plus the queue ahead of it), weighed by
overlap_score_weight (Dynamo's name; > 1 favours cache hits, < 1 a balanced load), plus the blocks
it keeps busy. Ties go to the fewest requests in flight, then round robin. Every input goes into
the route span (Choice.inputs).
"""
from __future__ import annotations

import itertools

from baton.services.router.kv_index import KVIndex
from baton.services.router.policies import Choice


class KVAware:
    def __init__(self, index: KVIndex, overlap_score_weight: float = 1.0, host_hit_weight: float = 0.5):
        self.index = index
        self.overlap_score_weight = overlap_score_weight
        self.host_hit_weight = host_hit_weight
        self._turn = itertools.count()

    def choose(self, backends: list, hashes: list[int]) -> Choice:
        overlaps = self.index.overlap([b.address for b in backends], hashes)
        prompt_blocks = len(hashes) + 1
        w = self.overlap_score_weight
        rows = []
        for b in backends:
            device, host = overlaps[b.address]
            new = prompt_blocks - device - self.host_hit_weight * host
            rows.append((device, host, b.queued_prefill_blocks, b.active_blocks,
                         -(w * (b.queued_prefill_blocks + new) + b.active_blocks)))
        turn = next(self._turn)
        order = sorted(range(len(backends)), key=lambda i: backends[i].address)
        rank = {i: (k - turn) % len(backends) for k, i in enumerate(order)}  # round robin among ties
        best = max(range(len(backends)), key=lambda i: (rows[i][4], -backends[i].outstanding, -rank[i]))
        device, host = rows[best][0], rows[best][1]
        most = max(r[0] + r[1] for r in rows)
        decision = ("kv_overlap" if device + host == most else "kv_load") if most else "kv_least_loaded"
        columns = list(zip(*rows))
        inputs = {"prompt_blocks": prompt_blocks, "overlap_device_blocks": list(columns[0]),
                  "overlap_host_blocks": list(columns[1]), "queued_prefill_blocks": list(columns[2]),
                  "active_blocks": list(columns[3]), "score": [round(s, 3) for s in columns[4]]}
        charge = (prompt_blocks - device - host, prompt_blocks)  # what the choice adds to its load
        return Choice(backends[best], decision, device + host, inputs, charge)
