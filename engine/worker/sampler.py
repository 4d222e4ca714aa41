"""Turn the logits of the step's sampled rows into tokens: logits processors (logit bias,
repetition, presence and frequency penalties), then greedy or temperature, min-p, top-k,
top-p; and the logprobs a request asks for, from the model's distribution before any of that
(vLLM's default).

A seeded request draws from its own torch.Generator, one draw per token, so its tokens do not
depend on what else is in the batch.
"""
from __future__ import annotations

import torch

from baton.engine.common.core_messages import TokenLogprobs
from baton.engine.common.sampling_params import SamplingParams


def token_logprobs(logprobs: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprobs]:
    """logprobs [R, V] (log-softmax of the raw logits), one row per token_ids entry."""
    ids = torch.tensor(token_ids, device=logprobs.device)
    chosen = logprobs.gather(1, ids[:, None])
    ranks = (logprobs > chosen).sum(dim=1) + 1
    chosen, ranks = chosen[:, 0].tolist(), ranks.tolist()
    if k:
        top = logprobs.topk(k, dim=1)
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
    else:
        top_ids = top_values = [[] for _ in token_ids]
    return [TokenLogprobs(t, lp, r, i, v) for t, lp, r, i, v in zip(token_ids, chosen, ranks, top_ids, top_values)]


def apply_processors(logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
                     token_ids: list[list[int]], num_prompt_tokens: list[int]) -> None:
    """In place, on the given rows: logit bias, then the repetition penalty over prompt and
    output tokens (transformers' definition: a positive logit divided, a negative multiplied),
    and the presence and frequency penalties over output tokens (OpenAI's)."""
    for row in rows:
        p, ids = params[row], token_ids[row]
        if p.logit_bias:
            logits[row, list(p.logit_bias)] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype,
                                                              device=logits.device)
        if p.repetition_penalty != 1.0:
            # A mask of the tokens seen, not unique(): that would wait for the device every row.
            seen = torch.zeros(logits.shape[1], dtype=torch.bool, device=logits.device)
            index = torch.tensor(ids, device=logits.device)
            seen[index[index >= 0]] = True  # (an image's placeholders are no token: core_messages.image_placeholder)
            scores = logits[row]
            penalized = torch.where(scores > 0, scores / p.repetition_penalty, scores * p.repetition_penalty)
            logits[row] = torch.where(seen, penalized, scores)
        if (p.presence_penalty or p.frequency_penalty) and len(ids) > num_prompt_tokens[row]:
            out = torch.tensor(ids[num_prompt_tokens[row]:], device=logits.device)
            counts = torch.zeros(logits.shape[1], dtype=logits.dtype, device=logits.device)
            counts.index_add_(0, out, torch.ones(out.shape, dtype=logits.dtype, device=logits.device))
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


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


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from: [R, V] probabilities of logits [R, V] (one row
    per entry of params, none greedy) after temperature, min-p, top-k and top-p."""
    sub = logits / torch.tensor([p.temperature for p in params], device=logits.device)[:, None]
    if any(p.min_p > 0 for p in params):  # after temperature, before top-k/top-p (vLLM's order)
        min_p = torch.tensor([p.min_p for p in params], device=logits.device)
        probs = sub.softmax(dim=-1)
        sub = sub.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        top_k = torch.tensor([p.top_k for p in params], device=logits.device)
        top_p = torch.tensor([p.top_p for p in params], device=logits.device)
        sub = _apply_top_k_top_p(sub, top_k, top_p)
    return sub.softmax(dim=-1)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> list[int]:
    """logits: [B, V] float32, one row per request; generators: one per row."""
    return sample_on_device(logits, params, generators).tolist()


def sample_on_device(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
                     ) -> torch.Tensor:
    """`sample`'s tokens [B] (int64), left on the logits' device."""
    greedy = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not random_rows:
        return greedy
    rows = torch.tensor(random_rows, device=logits.device)
    probs = sampling_probs(logits[rows], [params[i] for i in random_rows])
    # Exponential race (Gumbel-max in disguise): argmax(p / E) with E ~ Exp(1) samples from p;
    # each row's E from its own generator. On the device until one copy of every token to the host.
    noise = _noises(probs.shape[-1], probs.device, [generators[i] for i in random_rows])
    return greedy.index_copy(0, rows, (probs / noise).argmax(dim=-1))


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from probabilities [V] (they need not sum to 1), from the request's generator."""
    return int((probs / _noise(probs.shape[-1], probs.device, generator)).argmax())


def _noises(vocab_size: int, device, generators: list[torch.Generator]) -> torch.Tensor:
    """[rows, V] draws, each row from its generator: rows that share one (every unseeded
    request shares the engine's) in one launch, in row order, as row-by-row draws would be."""
    noise = torch.empty(len(generators), vocab_size, dtype=torch.float32, device=device)
    rows_of: dict[int, list[int]] = {}
    for row, generator in enumerate(generators):
        rows_of.setdefault(id(generator), []).append(row)
    for rows in rows_of.values():
        draws = _noise(vocab_size, device, generators[rows[0]], len(rows))
        if len(rows) == len(generators):
            return draws
        noise[torch.tensor(rows, device=device)] = draws
    return noise


def _noise(vocab_size: int, device, generator: torch.Generator, rows: int | None = None) -> torch.Tensor:
    """One sampling step's draw from a request's generator (float32, as the probabilities), or
    `rows` steps' draws at once."""
    shape = (vocab_size,) if rows is None else (rows, vocab_size)
    return torch.empty(shape, dtype=torch.float32, device=device).exponential_(generator=generator)


def skip_draws(generator: torch.Generator, num_steps: int, vocab_size: int, device) -> None:
    """Advance a seeded generator past the draws of tokens sampled elsewhere (a prefill peer),
    so the rest of the stream is what one engine would have sampled."""
    for _ in range(num_steps):
        _noise(vocab_size, device, generator)
