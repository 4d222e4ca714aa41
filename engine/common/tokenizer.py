"""The checkpoint's tokenizer and chat template, without torch: the router loads them too."""
from __future__ import annotations

import json
import os

from transformers import PreTrainedTokenizerFast

from baton.engine.common.config import read_config
from baton.engine.common.errors import check


def load_tokenizer(model_dir: str):
    """The checkpoint's tokenizer. With a tokenizer.json, the fast tokenizer class loads it
    directly: AutoTokenizer resolves the same class but imports transformers' modeling stack
    on the way (5-15 s of start-up on 2 cores)."""
    if os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer  # imports torch
    return AutoTokenizer.from_pretrained(model_dir)


def apply_chat_template(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                        tokenize: bool = True) -> list[int] | str:
    """A conversation's prompt token ids (its text, not `tokenize`), the assistant's turn opened
    for the reply. Tools go to
    a template that renders them; a template that knows none (SmolLM2's, ChatML's) gets them in
    a system prompt of Baton's own, asking for Hermes-style calls, which the tool parser reads;
    an agent's earlier calls and their results are then written as Hermes writes them."""
    check(tokenizer.chat_template is not None, "messages", "this checkpoint has no chat template")
    if "tool_calls" not in tokenizer.chat_template and any(m.get("tool_calls") or m.get("role") == "tool"
                                                            for m in messages):
        messages = hermes_history(messages)
    if tools and "tools" not in tokenizer.chat_template:
        messages, tools = with_tool_prompt(messages, tools), None
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=tokenize,
                                         return_dict=False)


def tool_prompt(tools: list[dict]) -> str:
    """The built-in system prompt that offers tools, for templates without tool support."""
    lines = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    return ("You can call functions to answer. Their signatures, one JSON object per line:\n"
            f"<tools>\n{lines}\n</tools>\n"
            "To call one, write a JSON object with its name and its arguments between tool_call tags, "
            "one call per pair of tags:\n"
            '<tool_call>\n{"name": "the function\'s name", "arguments": {"an argument": "its value"}}\n</tool_call>\n'
            "Results come back between tool_response tags.")


def hermes_history(messages: list[dict]) -> list[dict]:
    """An agent's history for a template that renders no tool turns: an assistant's calls as the
    Hermes blocks it wrote, a tool's result as a user turn between tool_response tags (the
    convention of Hermes and Qwen2.5, whose templates render them so)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                            "arguments": c["function"]["arguments"]},
                                                           ensure_ascii=False) + "\n</tool_call>"
                              for c in m["tool_calls"])
            m = {"role": m["role"], "content": f"{m['content']}\n{calls}" if m["content"] else calls}
        elif m.get("role") == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    return out


def with_tool_prompt(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The conversation with the tool prompt in its system message (added first when it has none)."""
    prompt = tool_prompt(tools)
    if messages and messages[0].get("role") == "system":
        return [dict(messages[0], content=f"{messages[0]['content']}\n\n{prompt}"), *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


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
