"""Quantized checkpoints on CPU, beside the float model they came from, in one run: the memory
their weights take, decode speed at batch 1 and 64, and what quantization costs in quality
(greedy agreement with the float model, perplexity on a fixed text); and a float prefill before a
quantized decode (accept_kv_from), against each alone.

Each scheme's checkpoint is written from the float one by baton.testing.quantized_checkpoints
(the formats as their tools publish them). Speed runs alternate float and quantized (A B B A)
and report the ratio of their means: machines are noisy.

    .venv/bin/python bench/quantized.py                      # SmolLM2, fp8-block ct-w4a16 gptq-4
    .venv/bin/python bench/quantized.py --schemes fp8-block --batch 1 --quick
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # nixl_engines.py: engines with the real connector, in one process

from nixl_engines import connect, disaggregated, nixl_engine  # noqa: E402

from baton import LLM, SamplingParams  # noqa: E402
from baton.engine.worker.loader import checkpoint_bytes  # noqa: E402
from baton.testing.quantized_checkpoints import quantize_checkpoint  # noqa: E402

# Scheme -> the writer's options for SmolLM2's shapes (576 hidden, 1536 intermediate: groups of 64).
SCHEMES = {"fp8-block": dict(block=(128, 128)), "ct-fp8-channel": {}, "ct-w4a16": dict(group_size=64),
           "gptq-4": dict(group_size=64), "awq": dict(group_size=64), "ct-w8a8-int": {}}
# Greedy agreement is measured on text a chat model continues with some confidence (random token ids
# give near-flat distributions, where any change flips the pick).
QUALITY_PROMPTS = ["The capital of France is", "Water boils at a temperature of", "The three primary colors are",
                   "A haiku about the sea:", "def fibonacci(n):", "The largest planet in the solar system is",
                   "Photosynthesis is the process by which", "To make a cup of tea, first"]
TEXT = ("The river ran north through the city, past the old market and the house where my mother was born. "
        "In the morning the water was still and grey; by noon boats crossed it with fruit, bread and letters. "
        "People in the city say the river is older than any name they have for it, and they may be right.")


def engine(model: str, **kwargs) -> LLM:
    return LLM(model, dtype="float32", device="cpu", max_num_seqs=64, **kwargs)


def resident_bytes(llm: LLM) -> int:
    model = llm.engine.runner.model
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def decode_speed(llm: LLM, batch: int, tokens: int, vocab: int) -> float:
    """Output tokens per second of `batch` requests of 32 prompt tokens and `tokens` outputs each."""
    ps = prompts(batch, 32, vocab, seed=batch)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate(ps[:1], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm
    start = time.perf_counter()
    llm.generate(ps, params)
    return batch * tokens / (time.perf_counter() - start)


def greedy(llm: LLM, ps: list, tokens: int) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(ps, SamplingParams(max_tokens=tokens, temperature=0.0,
                                                                 ignore_eos=True))]


def agreement(got: list[list[int]], want: list[list[int]]) -> dict:
    """Identical outputs, and the mean share of each output before its first differing token."""
    same_prefix = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w)) / len(w)
                   for g, w in zip(got, want)]
    return {"identical": sum(g == w for g, w in zip(got, want)) / len(want),
            "prefix_share": sum(same_prefix) / len(same_prefix)}


def perplexity(llm: LLM) -> float:
    """exp of the mean negative log-probability of TEXT's tokens, each given those before it."""
    out = llm.generate([TEXT], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))[0]
    values = [lp.logprob for lp in out.prompt_logprobs if lp is not None]
    return math.exp(-sum(values) / len(values))


def speed_pair(float_model: str, quant_model: str, batch: int, tokens: int, vocab: int) -> dict:
    runs = {"float": [], "quantized": []}
    for which in ("float", "quantized", "quantized", "float"):  # A B B A
        with engine(float_model if which == "float" else quant_model) as llm:
            runs[which].append(decode_speed(llm, batch, tokens, vocab))
    mean = {k: sum(v) / len(v) for k, v in runs.items()}
    return {"float_tok_s": mean["float"], "quantized_tok_s": mean["quantized"],
            "ratio": mean["quantized"] / mean["float"]}


def mixed_pair(float_model: str, quant_model: str, ps: list[str], tokens: int) -> list[list[int]]:
    """A float prefill before a quantized decode (the decode names the prefill's checkpoint):
    its greedy output against each engine alone."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    prefill = nixl_engine(float_model, "prefill")
    decode = nixl_engine(quant_model, "decode", accept_kv_from=[float_model])
    connect(prefill, decode)
    got = disaggregated(prefill, decode, ps, [params] * len(ps))
    prefill.close()
    decode.close()
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--schemes", nargs="*", default=["fp8-block", "ct-w4a16", "gptq-4"], choices=list(SCHEMES))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--tokens", type=int, default=32, help="output tokens per request in the speed runs")
    p.add_argument("--quick", action="store_true", help="fewer tokens and prompts (a smoke run)")
    p.add_argument("--checkpoint", nargs="+", default=[], metavar="NAME=DIR",
                   help="quantized checkpoints of --model made elsewhere (llm-compressor's or GPTQModel's, as "
                        "bench/quant_tools.sh writes them), measured as the schemes are")
    p.add_argument("--out", help="write the report as JSON here")
    args = p.parse_args()
    model = str((REPO / args.model) if not Path(args.model).is_absolute() else args.model)
    tokens = 8 if args.quick else args.tokens
    report = {"model": args.model, "schemes": {}}
    with engine(model) as llm:
        vocab = llm.engine.vocab_size
        report["float"] = {"resident_bytes": resident_bytes(llm), "perplexity": perplexity(llm),
                           "checkpoint_bytes": sum(checkpoint_bytes(model).values())}
        quality_prompts = QUALITY_PROMPTS[:4] if args.quick else QUALITY_PROMPTS
        want = greedy(llm, quality_prompts, 32)
    given = dict(item.split("=", 1) for item in args.checkpoint)
    with tempfile.TemporaryDirectory() as tmp:
        for scheme in [*args.schemes, *given]:
            quant = given.get(scheme) or quantize_checkpoint(model, f"{tmp}/{scheme}", f"{tmp}/{scheme}-ref", scheme,
                                                             spread=False, **SCHEMES[scheme])[0]
            row = {"checkpoint_bytes": sum(checkpoint_bytes(quant).values())}
            with engine(quant) as llm:
                row["resident_bytes"] = resident_bytes(llm)
                row["perplexity"] = perplexity(llm)
                row["greedy_vs_float"] = agreement(greedy(llm, quality_prompts, 32), want)
                colocated = greedy(llm, quality_prompts, 32)
            for batch in args.batch:
                row[f"batch_{batch}"] = speed_pair(model, quant, batch, tokens, vocab)
            mixed = mixed_pair(model, quant, quality_prompts, 32)
            row["float_prefill_quantized_decode"] = {"vs_quantized": agreement(mixed, colocated),
                                                     "vs_float": agreement(mixed, want)}
            report["schemes"][scheme] = row
            print(json.dumps({scheme: row}, indent=1), flush=True)
    print_table(report)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


def print_table(report: dict) -> None:
    f = report["float"]
    print(f"\n{report['model']}: float32 weights {f['resident_bytes'] / 2**20:.1f} MiB, "
          f"perplexity {f['perplexity']:.2f}")
    print(f"{'scheme':<16}{'MiB':>8}{'x ckpt':>8}{'ppl':>8}{'greedy=':>9}{'prefix':>8}  speed vs float32 (tok/s)")
    for scheme, r in report["schemes"].items():
        speeds = "  ".join(f"b{k.split('_')[1]} {v['ratio']:.2f}x ({v['quantized_tok_s']:.0f}/{v['float_tok_s']:.0f})"
                           for k, v in r.items() if k.startswith("batch_"))
        g = r["greedy_vs_float"]
        print(f"{scheme:<16}{r['resident_bytes'] / 2**20:>8.1f}{r['resident_bytes'] / r['checkpoint_bytes']:>8.2f}"
              f"{r['perplexity']:>8.2f}{g['identical']:>9.2f}{g['prefix_share']:>8.2f}  {speeds}")
        m = r["float_prefill_quantized_decode"]
        print(f"{'':<16}float prefill -> {scheme} decode: identical to {scheme} alone "
              f"{m['vs_quantized']['identical']:.2f}, to float alone {m['vs_float']['identical']:.2f}")


if __name__ == "__main__":
    main()
