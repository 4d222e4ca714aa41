"""Streaming text: the deltas add up to the full decode, and none carries a broken character."""
from __future__ import annotations

from transformers import AutoTokenizer

from baton import LLM, SamplingParams
from baton.engine.front.detokenizer import IncrementalDetokenizer


def test_deltas_concatenate_to_the_full_text_without_broken_utf8(tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    text = "naïve café in Zürich 😀 東京 north 😀😀 water"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens
    prompt = tok.encode("the capital of")
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.push([t], final=(i == len(ids) - 1)) for i, t in enumerate(ids)]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert sum(1 for d in deltas if d == "") > 0  # some tokens had to wait for the rest of a character


def test_engine_text_matches_decode_of_its_tokens(tiny_qwen2):
    llm = LLM(tiny_qwen2, dtype="float32", device="cpu")
    outs = llm.generate(["😀 café", "東京 north"],
                        SamplingParams(max_tokens=30, temperature=1.0, seed=3, ignore_eos=True))
    for out in outs:
        assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_the_engine_tokenizer_encodes_and_templates_like_autotokenizer(tiny_llama, tiny_qwen2, smollm2):
    from baton.engine.common.tokenizer import load_tokenizer

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "naïve 😀 question?"}]
    for model_dir in (tiny_llama, tiny_qwen2, smollm2):
        ours, auto = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
        for text in ("the capital of France is", " leading space", "東京 café\n\ttabs"):
            assert ours.encode(text) == auto.encode(text), (model_dir, text)
        assert (ours.eos_token_id, ours.bos_token_id) == (auto.eos_token_id, auto.bos_token_id)
        if auto.chat_template:
            assert ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
                auto.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
