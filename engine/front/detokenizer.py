"""Incremental detokenization for streaming: emit text only once it is whole.

Decoding token by token breaks multi-byte characters (a byte-level BPE may split one emoji
over several tokens) and drops the spaces some tokenizers attach to word starts. So each step
decodes a short window with the newest tokens and compares it with the same window without
them (kept from the step the window last moved); it emits the difference only when it does
not end in a replacement character.
"""
from __future__ import annotations

_CONTEXT_TOKENS = 5  # prompt tokens decoded as context for the first output tokens


class IncrementalDetokenizer:
    __slots__ = ("decoder", "token_ids", "prefix_offset", "read_offset", "prefix_text", "skip_special_tokens")

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        # The Rust tokenizer straight, unless transformers post-processes its output: its
        # Python wrapper costs ~5x the decode itself at one token per call.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        cleans_up = getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self.decoder = backend if backend is not None and not cleans_up else tokenizer
        self.skip_special_tokens = skip_special_tokens
        # (an image's placeholder positions hold no token: core_messages.image_placeholder)
        self.token_ids = [t for t in prompt_token_ids[-_CONTEXT_TOKENS:] if t >= 0]
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.prefix_text = self._decode(self.token_ids)

    def _decode(self, ids: list[int]) -> str:
        return self.decoder.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, new_token_ids: list[int], final: bool = False) -> str:
        """Add tokens; return the text that is now complete (all of it when `final`)."""
        self.token_ids.extend(new_token_ids)
        full_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(full_text) > len(self.prefix_text) and (final or not full_text.endswith("\ufffd")):
            new_text = full_text[len(self.prefix_text):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            self.prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
            return new_text
        return ""


class TextStream:
    """A request's text as it streams: detokenized incrementally and, when the request has stop
    strings, cut at the first one found. Text that could still turn out to begin a stop string
    is held back until it cannot, so a client never sees a character past a stop string."""

    __slots__ = ("detokenizer", "stops", "include_stop", "pending", "hands_over")

    def __init__(self, tokenizer, prompt_token_ids: list[int], stops: list[str] = (), include_stop: bool = False,
                 skip_special_tokens: bool = True):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self.stops = list(stops)
        self.include_stop = include_stop
        self.pending = ""  # decoded, not yet emitted
        self.hands_over = False  # the request goes on elsewhere when it ends by length (a prefill's)

    def push(self, new_token_ids: list[int], final: bool = False,
             look_for_stops: bool = True) -> tuple[str, str | None]:
        """Add tokens; returns the text to emit now and the stop string that ended the text, if
        one did (`look_for_stops` false: none can yet, min_tokens not reached). `final` flushes."""
        text = self.detokenizer.push(new_token_ids, final)
        if not self.stops:
            return text, None
        self.pending += text
        if look_for_stops:
            found = min(((i, s) for s in self.stops if (i := self.pending.find(s)) >= 0), default=None)
            if found is not None:
                at, stop = found
                out = self.pending[:at + (len(stop) if self.include_stop else 0)]
                self.pending = ""
                return out, stop
        if final:
            out, self.pending = self.pending, ""
            return out, None
        keep = max((n for s in self.stops for n in range(min(len(s) - 1, len(self.pending)), 0, -1)
                    if self.pending.endswith(s[:n])), default=0)
        out, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return out, None
