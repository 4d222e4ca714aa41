"""Turn the logits of the step's sampled rows into tokens: greedy, temperature, top-k, top-p.

A seeded request draws from its own torch.Generator, one draw per token, so its tokens do not
depend on what else is in the batch.
"""
from __future__ import annotations

import torch

from baton.engine.sampling_params import SamplingParams


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits [B, V] (already divided by temperature); top_k [B] (0 = off); top_p [B]."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, vocab)
    drop = ranks[None, :] >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> list[int]:
    """logits: [B, V] float32, one row per request; generators: one per row."""
    greedy = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not random_rows:
        return greedy.tolist()
    rows = torch.tensor(random_rows, device=logits.device)
    sub = logits[rows] / torch.tensor([params[i].temperature for i in random_rows], device=logits.device)[:, None]
    if any(params[i].top_k > 0 or params[i].top_p < 1.0 for i in random_rows):
        top_k = torch.tensor([params[i].top_k for i in random_rows], device=logits.device)
        top_p = torch.tensor([params[i].top_p for i in random_rows], device=logits.device)
        sub = _apply_top_k_top_p(sub, top_k, top_p)
    probs = sub.softmax(dim=-1)
    out = greedy.tolist()
    for j, i in enumerate(random_rows):
        # Exponential race (Gumbel-max in disguise): argmax(p / E) with E ~ Exp(1) samples from p.
        out[i] = int((probs[j] / _noise(probs.shape[-1], probs.device, generators[i])).argmax())
    return out


def _noise(vocab_size: int, device, generator: torch.Generator) -> torch.Tensor:
    """One sampling step's draw from a request's generator (float32, as the probabilities)."""
    return torch.empty(vocab_size, dtype=torch.float32, device=device).exponential_(generator=generator)


def skip_draws(generator: torch.Generator, num_steps: int, vocab_size: int, device) -> None:
    """Advance a seeded generator past the draws of tokens sampled elsewhere (a prefill peer),
    so the rest of the stream is what one engine would have sampled."""
    for _ in range(num_steps):
        _noise(vocab_size, device, generator)
