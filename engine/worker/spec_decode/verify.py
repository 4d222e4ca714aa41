"""Checking a request's drafts against the target model's logits at the draft positions, so
that what it outputs is what it would have without them.

Rows: the logits after the request's last token, then after each draft (k drafts, k + 1 rows).
Greedy: drafts are kept while each equals the argmax of the row before it; then that row's
argmax (a correction, or after every draft the bonus token). Sampled: rejection sampling
(Leviathan et al., 2023) with the proposer's distribution q one-hot at its draft (n-gram
drafts are deterministic): draft d is kept with probability p(d), else a token is drawn from p
without d (max(p - q, 0) renormalized), and after every draft one from the last row: each
output token follows the target's p exactly. Draws come from the request's generator, so a
seeded request repeats itself.
"""
from __future__ import annotations

import torch

from baton.engine.common.sampling_params import SamplingParams
from baton.engine.worker.sampler import draw, sampling_probs


def greedy_accept(argmax: list[int], drafts: list[int]) -> list[int]:
    """argmax: the k + 1 rows' argmax tokens. The kept drafts and the token after them."""
    n = 0
    while n < len(drafts) and drafts[n] == argmax[n]:
        n += 1
    return drafts[:n] + [argmax[n]]


def sampled_accept(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
                   generator: torch.Generator) -> list[int]:
    """logits: the k + 1 rows [k + 1, V] (processed). The kept drafts and the token after them."""
    probs = sampling_probs(logits, [params] * logits.shape[0])
    # One uniform per draft, drawn up front from the request's generator (k draws each step).
    uniforms = torch.rand(len(drafts), generator=generator, device=logits.device).tolist()
    accepted = probs[torch.arange(len(drafts), device=logits.device),
                     torch.tensor(drafts, device=logits.device)].tolist() if drafts else []
    for i, (u, p) in enumerate(zip(uniforms, accepted)):
        if u >= p:  # rejected: from the rest of the row's distribution
            residual = probs[i].clone()
            residual[drafts[i]] = 0.0
            return drafts[:i] + [draw(residual, generator)]
    return drafts + [draw(probs[len(drafts)], generator)]
