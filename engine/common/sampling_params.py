"""Per-request sampling parameters (vLLM's names and meanings), validated with errors that name
the field."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from baton.engine.common.errors import check
from baton.engine.common.structured_output import StructuredOutput

MAX_LOGPROBS = 20  # top tokens a request may ask for per position (vLLM's default max_logprobs)
MAX_N = 16  # completions of one prompt
SEED_LIMIT = 1 << 63  # seeds are 64-bit signed (the API's int64)
# Below this, temperature is greedy (vLLM's _SAMPLING_EPS): dividing by it would overflow the logits.
GREEDY_TEMPERATURE = 1e-5


def child_seed(seed: int, index: int) -> int:
    """The seed of the index-th of n completions: seed + index, wrapped into 64 bits."""
    return (seed + index + SEED_LIMIT) % (2 * SEED_LIMIT) - SEED_LIMIT


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) means no top-k cut
    min_p: float = 0.0  # drop tokens less likely than min_p × the likeliest
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings, found in the text as it streams
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0  # neither EOS, stop tokens nor stop strings end a request before this many
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and the output (HF's definition)
    presence_penalty: float = 0.0  # OpenAI's: minus this once a token appeared in the output
    frequency_penalty: float = 0.0  # OpenAI's: minus this per time a token appeared in the output
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    logprobs: int | None = None  # per output token: its logprob and rank, and this many top tokens
    prompt_logprobs: int | None = None  # the same for each prompt token (the first has none)
    skip_special_tokens: bool = True
    n: int = 1  # completions of the prompt (each its own request; they share the prompt's blocks)
    structured_output: StructuredOutput | None = None  # the output follows a JSON schema, a regex, ...

    def __post_init__(self):
        check(_integer(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
              f"must be an integer >= 1, got {self.max_tokens!r}")
        check(_number(self.temperature) and 0.0 <= self.temperature, "temperature",
              f"must be >= 0, got {self.temperature!r}")
        check(_number(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        check(_integer(self.top_k) and self.top_k >= -1, "top_k",
              f"must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        check(_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        check(self.seed is None or (_integer(self.seed) and -SEED_LIMIT <= self.seed < SEED_LIMIT), "seed",
              f"must be a 64-bit signed integer, got {self.seed!r}")
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        check(all(_integer(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "must be non-negative integers")
        check(_integer(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
              f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        check(_number(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
              f"must be > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(_number(value) and -2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value!r}")
        self.logit_bias = dict(self.logit_bias)
        for token, bias in self.logit_bias.items():
            check(_integer(token) and token >= 0, "logit_bias", f"keys must be token ids >= 0, got {token!r}")
            check(_number(bias) and -100.0 <= bias <= 100.0, "logit_bias",
                  f"values must be in [-100, 100], got {bias!r} for token {token}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or (_integer(value) and 0 <= value <= MAX_LOGPROBS), name,
                  f"must be in [0, {MAX_LOGPROBS}], got {value!r}")
        check(_integer(self.n) and 1 <= self.n <= MAX_N, "n", f"must be in [1, {MAX_N}], got {self.n!r}")
        check(self.structured_output is None or isinstance(self.structured_output, StructuredOutput),
              "structured_output", f"must be a StructuredOutput, got {type(self.structured_output).__name__}")
        if self.top_k == -1:
            self.top_k = 0
        self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalized(self) -> bool:
        """Whether any logits processor applies (the runner skips the work when none does)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias))

    @property
    def needs_host_between_steps(self) -> bool:
        """Whether a request's next step needs its tokens on the host first (a grammar's state,
        penalties over its history, logprobs, min_tokens' count): async scheduling does not
        schedule ahead of its steps."""
        return (self.structured_output is not None or self.penalized or self.logprobs is not None
                or self.prompt_logprobs is not None or bool(self.min_tokens))

    def child(self, index: int) -> SamplingParams:
        """The index-th of n completions: a request of its own whose seed, when there is one, is
        offset by the index (a different but reproducible stream); only the first asks for the
        prompt's logprobs. (services/rpc/fan_out.py splits API requests alike.)"""
        return dataclasses.replace(self, n=1, seed=None if self.seed is None else child_seed(self.seed, index),
                                   prompt_logprobs=self.prompt_logprobs if index == 0 else None)

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids the request names must exist in the model's vocabulary."""
        for name, ids in (("logit_bias", self.logit_bias), ("stop_token_ids", self.stop_token_ids)):
            bad = next((t for t in ids if t >= vocab_size), None)
            check(bad is None, name, f"token {bad} is outside the vocabulary of {vocab_size}")
