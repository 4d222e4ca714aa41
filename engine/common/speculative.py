"""Speculative decoding's configuration (vLLM's --speculative-config, its names): which proposer
drafts tokens, how many per step, and when speculation stops paying. Torch-free, validated with
errors that name the field."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields

from baton.engine.common.errors import check

METHODS = ("ngram", "suffix", "draft_model", "eagle", "eagle3", "mtp")
WITH_MODEL = ("draft_model", "eagle", "eagle3")  # the methods that take a checkpoint (`model`)
HEADS = ("eagle", "eagle3", "mtp")  # the methods that read the target's hidden states (spec_decode/eagle.py)
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # drafted per request per step
    # draft_model: a smaller checkpoint with the target's tokenizer; eagle, eagle3: an EAGLE head's
    # checkpoint (engine/worker/spec_decode/eagle.py); mtp: the checkpoint holding DeepSeek's
    # multi-token-prediction layer, by default the target's own (spec_decode/mtp.py)
    model: str | None = None
    # ngram (prompt lookup): the longest suffix of the request's tokens, of prompt_lookup_max
    # tokens down to prompt_lookup_min, found earlier in them proposes what followed it there.
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # suffix (engine/worker/spec_decode/suffix.py): the trees' depth, finished requests whose
    # outputs the shared tree keeps, drafts per matched token at most, and the least joint
    # likelihood a draft may have.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # Speculation is off in steps with at least this many running requests (None: always on): a
    # full batch is bound by compute, where verifying drafts costs more than it saves. Measured
    # (bench/spec_decode.py, SmolLM2 on 2 CPU cores, n-gram, 4 drafts): at 64 in flight a chat
    # workload lost 14% of its throughput (copying gained 30%); at 16, chat 0.95x, copy 1.44x.
    disable_by_batch_size: int | None = 32

    def __post_init__(self):
        field = "speculative_config."
        check(self.method in METHODS, field + "method",
              f"must be one of {', '.join(METHODS)}, got {self.method!r}")
        check(_int(self.num_speculative_tokens) and 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
              field + "num_speculative_tokens",
              f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {self.num_speculative_tokens!r}")
        check(_int(self.prompt_lookup_min) and self.prompt_lookup_min >= 1, field + "prompt_lookup_min",
              f"must be an integer >= 1, got {self.prompt_lookup_min!r}")
        check(_int(self.prompt_lookup_max) and self.prompt_lookup_max >= self.prompt_lookup_min,
              field + "prompt_lookup_max",
              f"must be an integer >= prompt_lookup_min ({self.prompt_lookup_min}), got {self.prompt_lookup_max!r}")
        if self.method in WITH_MODEL:
            what = "a draft" if self.method == "draft_model" else "an EAGLE head's"
            check(self.model is not None, field + "model", f"{what} checkpoint directory is what {self.method} takes")
        elif self.method != "mtp":
            check(self.model is None, field + "model", f"is for {', '.join(WITH_MODEL)} and mtp, not {self.method!r}")
        check(self.model is None or (isinstance(self.model, str) and os.path.isdir(self.model)), field + "model",
              f"must be a checkpoint directory, got {self.model!r}")
        check(_int(self.suffix_decoding_max_tree_depth) and self.suffix_decoding_max_tree_depth >= 2,
              field + "suffix_decoding_max_tree_depth", f"must be an integer >= 2, got "
                                                        f"{self.suffix_decoding_max_tree_depth!r}")
        check(_int(self.suffix_decoding_max_cached_requests) and self.suffix_decoding_max_cached_requests >= 0,
              field + "suffix_decoding_max_cached_requests",
              f"must be an integer >= 0, got {self.suffix_decoding_max_cached_requests!r}")
        for name in ("suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"):
            value = getattr(self, name)
            check(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0, field + name,
                  f"must be a number > 0, got {value!r}")
        limit = self.disable_by_batch_size
        check(limit is None or (_int(limit) and limit >= 1), field + "disable_by_batch_size",
              f"must be an integer >= 1, got {limit!r}")

    @property
    def lookahead(self) -> int:
        """Slots past a request's tokens its drafting writes KV into (a draft model's or an EAGLE
        or MTP head's own KV, kept in the target's blocks): allocated with them. A head's slot p
        takes token p + 1, so it writes one slot less than a draft model."""
        if self.method in HEADS:
            return self.num_speculative_tokens - 1
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """A SpeculativeConfig from itself, a dict (vLLM's JSON), or None."""
        if value is None or isinstance(value, cls):
            return value
        check(isinstance(value, dict), "speculative_config", f"must be an object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        check(not unknown, f"speculative_config.{unknown[0] if unknown else ''}",
              f"is not a speculative decoding setting (known: {', '.join(sorted(known))})")
        return cls(**value)


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
