"""The checkpoint's tokenizer and chat template, without torch: the router loads them too."""
from __future__ import annotations

import json
import os

from transformers import PreTrainedTokenizerFast

from baton.engine.config import read_config
from baton.engine.errors import check


def load_tokenizer(model_dir: str):
    """The checkpoint's tokenizer. With a tokenizer.json, the fast tokenizer class loads it
    directly: AutoTokenizer resolves the same class but imports transformers' modeling stack
    on the way (5-15 s of start-up on 2 cores)."""
    if os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer  # imports torch
    return AutoTokenizer.from_pretrained(model_dir)


def apply_chat_template(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """A conversation's prompt token ids, the assistant's turn opened for the reply."""
    check(tokenizer.chat_template is not None, "messages", "this checkpoint has no chat template")
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)


def eos_token_ids(model_dir: str, tokenizer=None) -> frozenset[int]:
    """The ids that end a generation: generation_config.json's, else config.json's, else the
    tokenizer's EOS token (loaded only when needed)."""
    path = os.path.join(model_dir, "generation_config.json")
    eos = None
    if os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
    if eos is None:
        eos = read_config(model_dir).get("eos_token_id")
    if eos is None:
        eos = (tokenizer or load_tokenizer(model_dir)).eos_token_id
    if eos is None:
        return frozenset()
    return frozenset(eos if isinstance(eos, list) else [eos])
