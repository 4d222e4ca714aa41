"""Time to first token of an image request on a LLaVA of random weights (a ViT-B/16 at 224 px: 196
image tokens, and a small Llama), offline, one request at a time, median of --repeat:

- cold: a picture the engine has not seen (its encoder runs, its prompt is computed);
- encoder-cache hit: the same picture under another text (its embeddings are still held: no
  encoder, the prompt computed);
- prefix-cache hit: the same picture and text again (the prompt's blocks found: neither);
- text only: a prompt of the same length without an image.

It also prints what a decode tier receives for an image in P/D (its span's KV blocks), beside the
pixels and the encoder run that computing the span there would need.

    python bench/images.py [--repeat 5] [--model DIR]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np

from baton import LLM, SamplingParams
from baton.testing.checkpoints import write_random_llava

VISION = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12}
TEXT = {"hidden_size": 512, "intermediate_size": 1408, "num_attention_heads": 8, "num_key_value_heads": 8,
        "num_hidden_layers": 8}


def ttft(llm: LLM, prompt: dict | list[int]) -> float:
    t0 = time.perf_counter()
    llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--model", help="a LLaVA checkpoint (default: a random one written here)")
    args = p.parse_args()
    model = args.model or write_random_llava(tempfile.mkdtemp() + "/llava", seed=1, image_size=224, patch_size=16,
                                             vision=VISION, text=TEXT)
    llm = LLM(model, dtype="float32", device="cpu")
    image_token, per_image = llm.engine.inputs.images.image_token_id, llm.engine.inputs.images.tokens_per_image
    rng = np.random.default_rng(0)
    rows = {"cold": [], "encoder-cache hit": [], "prefix-cache hit": [], "text only": []}
    for _ in range(args.repeat):
        picture = rng.integers(0, 256, (240, 320, 3), dtype=np.uint8)
        texts = [rng.integers(3, 500, 40).tolist() for _ in range(3)]
        with_image = [{"prompt_token_ids": t[:8] + [image_token] + t[8:], "multi_modal_data": {"image": picture}}
                      for t in texts[:2]]
        rows["cold"].append(ttft(llm, with_image[0]))
        rows["encoder-cache hit"].append(ttft(llm, with_image[1]))
        rows["prefix-cache hit"].append(ttft(llm, with_image[0]))
        rows["text only"].append(ttft(llm, texts[2] + rng.integers(3, 500, per_image).tolist()))
    print(f"LLaVA: ViT {VISION['num_hidden_layers']}x{VISION['hidden_size']} at 224 px ({per_image} image tokens), "
          f"Llama {TEXT['num_hidden_layers']}x{TEXT['hidden_size']}; prompts of {40 + per_image} tokens; "
          f"median of {args.repeat}")
    cold = statistics.median(rows["cold"])
    for name, times in rows.items():
        median = statistics.median(times)
        print(f"  {name:18s} TTFT {median * 1e3:8.1f} ms   {median / cold:5.2f}x cold")
    runner = llm.engine.runner
    kv_bytes = runner.kv_cache[0].nbytes // llm.engine.config.block_size * per_image
    encoder_s = statistics.median(rows["cold"]) - statistics.median(rows["encoder-cache hit"])
    print(f"  P/D: a decode READs {kv_bytes / 1024:.0f} KiB of KV for an image's span (float32) and runs nothing "
          f"of it; re-encoding there would take the {3 * 224 * 224 * 4 / 1024:.0f} KiB of pixels, {encoder_s:.3f} s "
          f"of encoder here, and the span's prefill")


if __name__ == "__main__":
    main()
