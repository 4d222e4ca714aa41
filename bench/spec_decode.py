"""Speculative decoding on SmolLM2: each proposer against no speculation, in the same run.

Workloads: "copy" (the model is asked to repeat, or lightly edit, a given text or piece of code:
what n-gram drafts are for) and "chat" (open questions: little to copy). Each is run closed-loop
at 1, 4, 16 and 64 requests in flight, greedy, so every configuration must produce the same
tokens (checked). Reported per configuration: TPOT p50 (a request's time per output token after
its first; a step that yields several tokens shares its time among them), output tokens/s, and
the drafts' acceptance by position. Proposers: none, ngram, suffix, with --draft a draft model (a
random-weight two-layer model with SmolLM2's tokenizer) and with --eagle random-weight EAGLE-1 and
EAGLE-3 heads (their drafts are wrong: what they show is the proposer's cost).

    .venv/bin/python bench/spec_decode.py
    .venv/bin/python bench/spec_decode.py --inflight 1 4 --workload copy --max-tokens 128
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from baton.engine.common.config import EngineConfig
from baton.engine.common.sampling_params import SamplingParams
from baton.engine.offline.llm_engine import LLMEngine

REPO = Path(__file__).resolve().parent.parent
SOURCES = ["engine/core/scheduler.py", "engine/worker/sampler.py", "kernels/attention.py", "engine/core/request.py"]
TOPICS = ["why the sky is blue", "how a bicycle stays upright", "what a compiler does", "how bread rises",
          "why cats purr", "how tides work", "what a database index is", "how vaccines train the body"]


def copy_prompts(n: int) -> list[list[dict]]:
    """Repeat or edit a snippet of this repository's code or its docstrings."""
    snippets = []
    for path in SOURCES:
        lines = (REPO / path).read_text().splitlines()
        snippets += ["\n".join(lines[i:i + 24]) for i in range(40, len(lines) - 24, 60)]
    asks = ["Repeat the following code exactly, with no commentary:\n\n{}",
            "Rewrite this code with every comment removed, otherwise unchanged:\n\n{}",
            "Copy this text back to me word for word:\n\n{}"]
    return [[{"role": "user", "content": asks[i % len(asks)].format(snippets[i % len(snippets)])}] for i in range(n)]


def chat_prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Explain {TOPICS[i % len(TOPICS)]} in a few paragraphs."}]
            for i in range(n)]


def random_draft(model: str, out: str) -> str:
    """A two-layer Llama of random weights with the model's tokenizer and vocabulary."""
    import torch
    import transformers

    cfg = json.loads((Path(model) / "config.json").read_text())
    config = transformers.LlamaConfig(vocab_size=cfg["vocab_size"], hidden_size=128, intermediate_size=256,
                                      num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                      max_position_embeddings=cfg["max_position_embeddings"], tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(model) / name, Path(out) / name)
    return out


def run(model: str, prompts: list[list[int]], inflight: int, max_tokens: int, spec: dict | None) -> dict:
    engine = LLMEngine(EngineConfig.from_kwargs(model, dtype="float32", device="cpu", max_num_seqs=max(inflight, 1),
                                                speculative_config=spec))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    pending = list(enumerate(prompts))
    times: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}
    start = time.perf_counter()

    def admit():
        i, prompt = pending.pop(0)
        engine.add_request(str(i), prompt, params, detokenize=False)
        times[str(i)], tokens[str(i)] = [], []

    for _ in range(min(inflight, len(pending))):
        admit()
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            times[out.request_id] += [now] * len(out.new_token_ids)
            tokens[out.request_id] += out.new_token_ids
            if out.finished and pending:
                admit()
    wall = time.perf_counter() - start
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
    stats = engine.scheduler.spec_stats
    drafts = max(stats.num_drafts, 1)
    return {"tpot_p50_ms": round(statistics.median(tpot) * 1e3, 2),
            "tokens_per_s": round(sum(map(len, tokens.values())) / wall, 1),
            "acceptance_by_position": [round(n / drafts, 3) for n in stats.accepted_per_pos],
            "mean_accepted": round(stats.num_accepted_tokens / drafts, 2), "drafts": stats.num_drafts,
            "tokens": [tokens[str(i)] for i in range(len(prompts))]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(REPO / "models/smollm2-135m-instruct"))
    p.add_argument("--inflight", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--workload", nargs="+", default=["copy", "chat"], choices=["copy", "chat"])
    p.add_argument("--requests-per-slot", type=int, default=2, help="requests = this x in flight (at least 4)")
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--disable-by-batch-size", type=int, default=None,
                   help="speculation off from this many running requests (default: the engine's; 0: never)")
    p.add_argument("--draft", action="store_true", help="also a random-weight draft model (its cost)")
    p.add_argument("--eagle", action="store_true", help="also random-weight EAGLE-1 and EAGLE-3 heads (their cost)")
    p.add_argument("--json", help="write the figures here too")
    args = p.parse_args()
    proposers = {"ngram": {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens},
                 "suffix": {"method": "suffix", "num_speculative_tokens": args.num_speculative_tokens}}
    if args.draft:
        proposers["draft"] = {"method": "draft_model", "num_speculative_tokens": args.num_speculative_tokens,
                              "model": random_draft(args.model, tempfile.mkdtemp())}
    if args.eagle:
        from baton.testing.eagle_heads import write_head

        for method in ("eagle", "eagle3"):  # (EAGLE-3 on vLLM's default layers: 2, L // 2, L - 3)
            head = write_head(tempfile.mkdtemp(), args.model, method, aux_layers=None, target_shape=True)
            proposers[method] = {"method": method, "num_speculative_tokens": args.num_speculative_tokens,
                                 "model": head}
    for spec in proposers.values():
        if args.disable_by_batch_size is not None:  # (0: never off)
            spec["disable_by_batch_size"] = args.disable_by_batch_size or None
    chat_template = LLMEngine(EngineConfig.from_kwargs(args.model, dtype="float32", device="cpu", num_kv_blocks=64,
                                                       max_model_len=1024))
    report = []
    print(f"{'workload':8} {'inflight':>8} {'proposer':8} {'TPOT p50 ms':>12} {'tok/s':>8} {'TPOT x':>7} "
          f"{'tok/s x':>8} {'mean acc':>8}  acceptance by position")
    for workload in args.workload:
        for inflight in args.inflight:
            n = max(4, args.requests_per_slot * inflight)
            convs = (copy_prompts if workload == "copy" else chat_prompts)(n)
            prompts = [chat_template.apply_chat_template(c) for c in convs]
            results = {"none": run(args.model, prompts, inflight, args.max_tokens, None)}
            results.update((name, run(args.model, prompts, inflight, args.max_tokens, spec))
                           for name, spec in proposers.items())
            base = results["none"]
            want = base.pop("tokens")
            for name, r in results.items():
                same = name == "none" or r.pop("tokens") == want
                row = {"workload": workload, "inflight": inflight, "proposer": name, **r}
                if name != "none":
                    row["tpot_ratio"] = round(base["tpot_p50_ms"] / r["tpot_p50_ms"], 2)
                    row["throughput_ratio"] = round(r["tokens_per_s"] / base["tokens_per_s"], 2)
                    row["same_tokens"] = same
                report.append(row)
                print(f"{workload:8} {inflight:>8} {name:8} {r['tpot_p50_ms']:>12} {r['tokens_per_s']:>8} "
                      f"{row.get('tpot_ratio', ''):>7} {row.get('throughput_ratio', ''):>8} "
                      f"{r['mean_accepted'] if name != 'none' else '':>8}  "
                      f"{r['acceptance_by_position'] if name != 'none' else ''}"
                      f"{'' if same or name == 'none' else '  OUTPUT DIFFERS'}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
