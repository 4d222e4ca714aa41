"""Per-request sampling parameters, validated with errors that name the field."""
from __future__ import annotations

from dataclasses import dataclass, field

from baton.engine.errors import check


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) means no top-k cut
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0

    def __post_init__(self):
        check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        check(isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature, "temperature", f"must be >= 0, got {self.temperature!r}")
        check(isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", f"must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        check(self.seed is None or isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be non-negative integers")
        check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if self.top_k == -1:
            self.top_k = 0
        self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
