"""A prompt's block hashes at the router, as the engines' prefix caches hash it, for the
policies that route by them (prefix_affinity, kv_aware): of its token ids when the router has
the checkpoint's tokenizer, else of its UTF-8 bytes."""
from __future__ import annotations

import asyncio

from baton.engine.common.block_hashes import extend_block_hashes
from baton.engine.common.errors import InvalidArgument
from baton.services.rpc.chat import chat_messages, chat_tools
from baton.v1 import generate_pb2 as pb

HASHING_POLICIES = ("prefix_affinity", "kv_aware")  # they hash the prompt's blocks as the engines do


class PromptHasher:
    """`block_size`: the engines'; `max_blocks`: the deepest prefix hashed (None: the whole
    prompt, as kv_aware weighs it). The tokenizer, from `tokenizer_dir`, comes with `load`."""

    def __init__(self, tokenizer_dir: str | None, block_size: int, max_blocks: int | None):
        self.tokenizer_dir = tokenizer_dir
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.tokenizer = None  # also the HTTP front's, for its logprobs' token strings

    async def load(self) -> None:
        """Load the checkpoint's tokenizer, when the router was given its directory (off the
        event loop: it takes a while)."""
        if self.tokenizer_dir:
            from baton.engine.common.tokenizer import load_tokenizer
            self.tokenizer = await asyncio.to_thread(load_tokenizer, self.tokenizer_dir)

    def hashes(self, msg: pb.GenerateRequest, root: int) -> list[int]:
        """Block hashes of the prompt's start (or all of it), its chain starting at `root` (a
        LoRA adapter's, or the base model's)."""
        kind = msg.WhichOneof("prompt")
        if kind == "token_ids":
            units = list(msg.token_ids.ids)
        elif kind == "text":
            units = self.tokenizer.encode(msg.text) if self.tokenizer else list(msg.text.encode())
        elif kind == "chat":
            try:
                messages = chat_messages(msg.chat)
                if self.tokenizer is not None and self.tokenizer.chat_template and messages:
                    from baton.engine.common.tokenizer import apply_chat_template  # loaded with the tokenizer
                    units = apply_chat_template(self.tokenizer, messages, chat_tools(msg.chat))
                else:
                    units = list("\n".join(f"{m['role']}: {m['content']}" for m in messages).encode())
            except InvalidArgument:  # the engine refuses it, naming the field
                return []
        else:
            return []
        return extend_block_hashes([], units, self.block_size, self.max_blocks, root)
