"""A prompt's block hashes at the router, as the engines' prefix caches hash it, for the
policies that route by them (prefix_affinity, kv_aware): of its token ids when the router has
the checkpoint's tokenizer, else of its UTF-8 bytes.

A chat with images is hashed up to its first image only. An engine's blocks from there on hash
the image's digest, of its processed pixels, which only fetching and processing the image would
tell; the blocks before it are the same text whatever the image, and hash as the engines do."""
from __future__ import annotations

import asyncio

from baton.engine.common.block_hashes import extend_block_hashes
from baton.engine.common.errors import InvalidArgument
from baton.services.rpc.chat import chat_messages, chat_tools, has_images
from baton.v1 import generate_pb2 as pb

HASHING_POLICIES = ("prefix_affinity", "kv_aware")  # they hash the prompt's blocks as the engines do
IMAGE_MARK = "\ue000"  # (a private-use character) where a chat's first image goes, to cut the prompt there


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
                units = self._chat_units(msg.chat)
            except InvalidArgument:  # the engine refuses it, naming the field
                return []
        else:
            return []
        return extend_block_hashes([], units, self.block_size, self.max_blocks, root)

    def _chat_units(self, chat: pb.Chat) -> list[int]:
        """A chat's token ids (or bytes), up to its first image."""
        images = has_images(chat)
        messages = chat_messages(chat, IMAGE_MARK if images else "")
        if self.tokenizer is None or not self.tokenizer.chat_template or not messages:
            text = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
            return list(text.split(IMAGE_MARK)[0].encode())
        from baton.engine.common.tokenizer import apply_chat_template  # loaded with the tokenizer
        if not images:
            return apply_chat_template(self.tokenizer, messages, chat_tools(chat))
        text = apply_chat_template(self.tokenizer, messages, chat_tools(chat), tokenize=False)
        # The last token before the image may merge with the image's own text (Gemma's "\n\n")
        # in the engine's tokenization: it is left out.
        return self.tokenizer.encode(text.split(IMAGE_MARK)[0], add_special_tokens=False)[:-1]
