"""The `kv_aware` policy: the instance whose prefix cache already holds most of the prompt,
weighed against its load, as Dynamo's KV router scores workers.

For each candidate i, from the router's KV index (kv_index.py) and its own ledger of what it
sent where (Backend.charge):
  D_i  the prompt's leading blocks i holds in device memory
  H_i  the blocks after those that i holds in host memory only
  Q_i  prompt blocks routed to i that it has not computed yet (their first token has not come
       back): the prefill queue this request would wait behind
  A_i  prompt blocks of the requests in flight at i, whatever their state: what it keeps busy

  score_i = overlap_score_weight * (D_i + host_hit_weight * H_i) - (Q_i + active_weight * A_i)

The highest score wins among the candidates within prefix_affinity's load bound (requests in
flight at most load_factor x the mean, or slack above the least loaded); ties go to the fewest
requests in flight, then round robin. Every input goes into the route span (Choice.inputs).

Why these weights. A block held is a block not computed before the first token, and a block
queued is one computed before it: with overlap_score_weight 1 and active_weight 0 the score is,
up to a constant, minus the blocks to compute before this request's first token, the TTFT-greedy
choice (Dynamo's cost with its overlap_score_weight 1, less its active-blocks term). Greedy
scatters a conversation as soon as its instance has a queue, and then each of its copies is
evicted sooner: hits today cost hits tomorrow. Hence overlap_score_weight 8 by default: a
conversation moves when its instance's queue exceeds eight times what it would save. A running
request's blocks slow each step by a token each, not by a block of prefill, but they fill the
pool and push cached blocks out: active_weight 0.25. A block in host memory is loaded, not
computed, at a fraction of the cost: host_hit_weight 0.5. bench/kv_routing.py measures the
choice (docs/architecture.md has the figures).

Why a bound besides the score. Blocks every instance but a cold one holds (a shared system
prompt) count against the cold one in every decision, and a load term that grows a request at a
time catches up slowly: the cold instance may never get a request, so never hold the prefix.
The bound sends it one once the others are loaded enough, and from then on it competes.
"""
from __future__ import annotations

import itertools

from baton.services.router.kv_index import KVIndex
from baton.services.router.policies import Choice


class KVAware:
    def __init__(self, index: KVIndex, overlap_score_weight: float = 8.0, host_hit_weight: float = 0.5,
                 active_weight: float = 0.25, load_factor: float = 1.5, slack: int = 4):
        self.index = index
        self.overlap_score_weight = overlap_score_weight
        self.host_hit_weight = host_hit_weight
        self.active_weight = active_weight
        self.load_factor, self.slack = load_factor, slack
        self._turn = itertools.count()

    def choose(self, backends: list, hashes: list[int]) -> Choice:
        overlaps = self.index.overlap([b.address for b in backends], hashes)
        prompt_blocks = len(hashes) + 1
        w, wh, wa = self.overlap_score_weight, self.host_hit_weight, self.active_weight
        rows = []
        for b in backends:
            device, host = overlaps[b.address]
            rows.append((device, host, b.queued_prefill_blocks, b.active_blocks,
                         w * (device + wh * host) - (b.queued_prefill_blocks + wa * b.active_blocks)))
        turn = next(self._turn)
        order = sorted(range(len(backends)), key=lambda i: backends[i].address)
        rank = {i: (k - turn) % len(backends) for k, i in enumerate(order)}  # round robin among ties
        loads = [b.outstanding for b in backends]
        bound = max(self.load_factor * (sum(loads) + 1) / len(backends), min(loads) + self.slack)
        allowed = [i for i, n in enumerate(loads) if n + 1 <= bound] or range(len(backends))
        best = max(allowed, key=lambda i: (rows[i][4], -loads[i], -rank[i]))
        device, host = rows[best][0], rows[best][1]
        most = max(r[0] + r[1] for r in rows)
        decision = ("kv_overlap" if device + host == most else "kv_load") if most else "kv_least_loaded"
        columns = list(zip(*rows))
        inputs = {"prompt_blocks": prompt_blocks, "overlap_device_blocks": list(columns[0]),
                  "overlap_host_blocks": list(columns[1]), "queued_prefill_blocks": list(columns[2]),
                  "active_blocks": list(columns[3]), "score": [float(round(s, 3)) for s in columns[4]],
                  "outstanding": loads, "load_bound": float(bound)}
        charge = (prompt_blocks - device - host, prompt_blocks)  # what the choice adds to its load
        return Choice(backends[best], decision, device + host, inputs, charge)
