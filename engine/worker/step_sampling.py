"""A step's next tokens from its logits, each request's as its sampling parameters say (min_tokens,
penalties, its grammar's mask, temperature and the rest: sampler.py), or, for a request with
drafts, its drafts verified against rows processed as its single row would be after each
(spec_decode/verify.py); logprobs from the rows as they came, before any processing. The model
runner (model_runner.py) owns the requests' state; this reads and extends it."""
from __future__ import annotations

import torch

from baton.engine.common.scheduler_output import ModelRunnerOutput
from baton.engine.worker import sampler
from baton.engine.worker.grammar import mask_logits
from baton.engine.worker.sampler import apply_processors, token_logprobs
from baton.engine.worker.spec_decode.verify import greedy_accept, sampled_accept


class StepSampler:
    """`states`: the runner's RequestStates by request id (model_runner.py), shared."""

    def __init__(self, states: dict, eos_token_ids: frozenset[int]):
        self.states = states
        self.eos_token_ids = eos_token_ids

    def sample(self, logits: torch.Tensor, sampled_ids: list[str], out: ModelRunnerOutput) -> None:
        """One token for each request of sampled_ids (logits: a row each)."""
        states = [self.states[r] for r in sampled_ids]
        params = [s.sampling_params for s in states]
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw = logits[want].float().log_softmax(dim=-1) if want else None  # before any processing
        self._suppress_stops_before_min_tokens(logits, states)
        processed = [i for i, p in enumerate(params) if p.penalized]
        if processed:
            apply_processors(logits, processed, params, [s.token_ids for s in states],
                             [s.num_prompt_tokens for s in states])
        constrained = [i for i, s in enumerate(states) if s.matcher is not None]
        if constrained:
            mask_logits(logits, constrained, [states[i].matcher for i in constrained])
        tokens = sampler.sample(logits, params, [s.generator for s in states])
        for state, token in zip(states, tokens):
            state.draft_computed = min(state.draft_computed, len(state.token_ids))  # a draft fed there is stale
            state.token_ids.append(token)
        for i in constrained:
            matcher = states[i].matcher.grammar
            matcher.accept_token(tokens[i])
            if matcher.is_terminated():
                out.grammar_ended.add(sampled_ids[i])
        out.sampled_token_ids.update((r, [t]) for r, t in zip(sampled_ids, tokens))
        if want:
            k = max(params[i].logprobs for i in want)
            for i, lp in zip(want, token_logprobs(raw, [tokens[i] for i in want], k)):
                n = params[i].logprobs
                lp.top_token_ids, lp.top_logprobs = lp.top_token_ids[:n], lp.top_logprobs[:n]
                out.logprobs[sampled_ids[i]] = [lp]

    def verify(self, logits: torch.Tensor, spans: list[tuple[int, int]], sampled_ids: list[str],
               drafts_of: dict[str, list[int]], out: ModelRunnerOutput) -> None:
        """The drafts of each request that has k > 0 (its k + 1 rows of logits): the kept ones
        and one more, their logprobs where asked for (from the raw rows, as without drafts)."""
        rows = [(req_id, first, n) for req_id, (first, n) in zip(sampled_ids, spans) if n > 1]
        argmax = logits.argmax(dim=-1).tolist()
        for req_id, first, n in rows:
            state, drafts = self.states[req_id], drafts_of[req_id]
            params = state.sampling_params
            rows_logits = logits[first:first + n]
            raw = rows_logits.float().log_softmax(dim=-1) if params.logprobs is not None else None  # unprocessed
            shaped = params.penalized or state.matcher is not None or params.min_tokens
            fed = self._shape_draft_rows(rows_logits, state, drafts) if shaped else 0
            if params.greedy:
                tokens = greedy_accept(rows_logits.argmax(dim=-1).tolist() if shaped else argmax[first:first + n],
                                       drafts)
            else:
                tokens = sampled_accept(rows_logits, drafts, params, state.generator)
            if state.matcher is not None:  # the kept tokens, from where the request was, up to the grammar's end
                matcher = state.matcher.grammar
                matcher.rollback(fed)
                for i, token in enumerate(tokens):
                    matcher.accept_token(token)
                    if matcher.is_terminated():
                        tokens = tokens[:i + 1]
                        out.grammar_ended.add(req_id)
                        break
            # A draft model saw its drafts: right up to the last one kept.
            state.draft_computed = min(state.draft_computed, len(state.token_ids) + len(tokens) - 1)
            state.token_ids.extend(tokens)
            out.sampled_token_ids[req_id] = tokens
            if raw is not None:
                out.logprobs[req_id] = token_logprobs(raw[:len(tokens)], tokens, params.logprobs)

    def _suppress_stops_before_min_tokens(self, logits: torch.Tensor, states: list, ahead: bool = False) -> None:
        """Stop tokens out of row i's logits while the request has fewer than min_tokens outputs
        (`ahead`: the rows are one request's, row i after i more tokens, its drafts)."""
        for row, state in enumerate(states):
            params = state.sampling_params
            outputs = len(state.token_ids) - state.num_prompt_tokens + (row if ahead else 0)
            if outputs < params.min_tokens:
                stops = list(params.stop_token_ids)
                if not params.ignore_eos:
                    stops.extend(self.eos_token_ids)
                if stops:
                    logits[row, stops] = float("-inf")

    def _shape_draft_rows(self, logits: torch.Tensor, state, drafts: list[int]) -> int:
        """A request's k + 1 rows processed as its single row would be after each draft: stop
        tokens held back before min_tokens, penalties over the tokens before the row, the
        grammar's mask in the state the drafts before the row lead to. Returns the drafts fed to
        the grammar matcher (up to the first it refuses: verification stops there anyway); the
        caller rolls them back."""
        k, params = len(drafts), state.sampling_params
        self._suppress_stops_before_min_tokens(logits, [state] * (k + 1), ahead=True)
        if params.penalized:
            apply_processors(logits, list(range(k + 1)), [params] * (k + 1),
                             [state.token_ids + drafts[:i] for i in range(k + 1)], [state.num_prompt_tokens] * (k + 1))
        fed = 0
        if state.matcher is not None:
            for i in range(k + 1):
                mask_logits(logits, [i], [state.matcher])
                if i == k or not state.matcher.grammar.accept_token(drafts[i]):
                    break
                fed += 1
        return fed
