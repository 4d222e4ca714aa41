"""Incremental detokenization for streaming: emit text only once it is whole.

Decoding token by token breaks multi-byte characters (a byte-level BPE may split one emoji
over several tokens) and drops the spaces some tokenizers attach to word starts. So each step
decodes a short window twice, with and without the newest tokens, and emits the difference
only when it does not end in a replacement character.
"""
from __future__ import annotations

_CONTEXT_TOKENS = 5  # prompt tokens decoded as context for the first output tokens


class IncrementalDetokenizer:
    __slots__ = ("tokenizer", "token_ids", "prefix_offset", "read_offset", "skip_special_tokens")

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, new_token_ids: list[int], final: bool = False) -> str:
        """Add tokens; return the text that is now complete (all of it when `final`)."""
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(full_text) > len(prefix_text) and (final or not full_text.endswith("\ufffd")):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            return full_text[len(prefix_text):]
        return ""
