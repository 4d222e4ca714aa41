"""The model runner's side of speculative decoding: its proposer (one of this package's) made
for the runner's model and KV cache, fed what it needs as steps run (the hidden states of the
positions whose tokens stand, for a head; a prefill's draft KV completed before its blocks go
to a decode) and asked for the next step's drafts."""
from __future__ import annotations

import functools

import torch

from baton.engine.common.config import EngineConfig
from baton.engine.common.scheduler_output import ModelRunnerOutput, SchedulerOutput
from baton.engine.worker.attention_backend import choose_backend
from baton.engine.worker.models import CausalLM


def model_proposer(draft: torch.nn.Module, target: CausalLM, config: EngineConfig, device: torch.device,
                   kv_dtype: torch.dtype, metadata, full_group: int, num_blocks: int):
    """draft_model's proposer over `draft`, or a head's (EAGLE's or DeepSeek's MTP layer), its
    KV in a cache of `num_blocks` blocks addressed as `full_group`'s (a full-attention group of
    the target's); `metadata`: the runner's batch builder's attention metadata."""
    from baton.engine.worker.spec_decode.draft_model import DraftModelProposer
    from baton.engine.worker.spec_decode.eagle import EagleProposer

    a = draft.args
    latent = a.attention == "mla"
    backend = choose_backend(config.attention_backend, target.embed_tokens.weight.dtype, device, a.num_heads,
                             a.num_kv_heads, a.head_dim, latent=latent, kv_dtype=kv_dtype)
    # (a partial of the batch builder's, not a closure over the runner: the proposer is the
    # runner's, and such a cycle only the garbage collector frees, the model and caches with it)
    metadata = functools.partial(metadata, backend=backend, latent=latent)
    if not isinstance(draft, CausalLM):  # a head: it reads the target's hidden states
        return EagleProposer(draft, target, num_blocks, config.block_size, config.max_model_len, full_group,
                             config.max_num_batched_tokens, metadata, device, kv_dtype)
    return DraftModelProposer(draft, num_blocks, config.block_size, config.max_model_len, full_group, metadata,
                              device, config.max_num_batched_tokens, kv_dtype)


class Drafting:
    """A runner's proposer at work (on the driver only: a rank that samples nothing drafts nothing).
    `states`: the runner's RequestStates by request id, shared."""

    def __init__(self, proposer, num_spec_tokens: int, states: dict, device: torch.device):
        self.proposer, self.num_spec_tokens, self.states, self.device = proposer, num_spec_tokens, states, device

    def keep_hidden(self, batch, hidden: torch.Tensor, sched: SchedulerOutput, out: ModelRunnerOutput) -> None:
        """Hand the proposer (a head, which wants them) the hidden states of the step's positions
        whose tokens stand: each request's rows, less its rejected drafts'."""
        rows, row = [], 0
        for (req_id, n), (start, _, _) in zip(batch.order, batch.spans):
            # With drafts (n = 1 + drafts): the last token's row and the kept drafts' (one per token out).
            kept = len(out.sampled_token_ids[req_id]) if req_id in sched.scheduled_spec_tokens else n
            rows.append((self.states[req_id], row, start, kept))
            row += n
        self.proposer.keep(rows, hidden)

    def complete_draft_kv(self, out: ModelRunnerOutput) -> None:
        """A prefill's requests that end here: their draft's or head's KV of every prompt position
        (a head's last with the token just sampled) written now, before their blocks go to a decode."""
        ending = [r for r in out.sampled_token_ids if self.states[r].hold_for_remote]
        if ending:
            self.proposer.catch_up([self.states[r] for r in ending])
            out.draft_start.update((r, self.proposer.start(self.states[r])) for r in ending)
            if self.device.type == "cuda":  # a peer's READ may start as soon as the step's output is out
                torch.cuda.current_stream(self.device).synchronize()

    def propose(self, req_ids: list[str], out: ModelRunnerOutput, grammars) -> None:
        """Drafts for the next step: the proposer's, or where a request's grammar allows one
        continuation only, that continuation's tokens (free: no model guessed them; `grammars`:
        the runner's Grammars, worker/grammar.py)."""
        asking = []
        for req_id in req_ids:
            state = self.states.get(req_id)
            if state is None or req_id not in out.sampled_token_ids or req_id in out.grammar_ended:
                continue
            left = state.sampling_params.max_tokens - (len(state.token_ids) - state.num_prompt_tokens)
            if left <= 1:  # no room for a draft before the last token (a prefill's request: none at all)
                continue
            forced = grammars.forced(state.matcher, self.num_spec_tokens) if state.matcher is not None else []
            if forced:
                out.spec_token_ids[req_id] = forced
            else:
                asking.append(req_id)
        if asking:
            for req_id, drafts in zip(asking, self.proposer.propose([self.states[r] for r in asking],
                                                                    self.num_spec_tokens)):
                if drafts:
                    out.spec_token_ids[req_id] = drafts
