"""Time to first token of an image request on a vision-language model of random weights, offline,
one request at a time, median of --repeat: a LLaVA (a ViT-B/16 at 224 px: 196 image tokens, and a
small Llama), or with --family qwen a Qwen2.5-VL (a 12-layer ViT of 14-pixel patches in 112-pixel
windows, the 320x240 picture at its own resolution: 99 tokens, and a small Qwen2 with M-RoPE), or
with --family gemma a Gemma 3 (a SigLIP ViT-B/16 at 224 px pooled to 49 tokens whose steps attend
on the PyTorch reference, over a small Gemma 3 text model):

- cold: a picture the engine has not seen (its encoder runs, its prompt is computed);
- encoder-cache hit: the same picture under another text (its embeddings are still held: no
  encoder, the prompt computed);
- prefix-cache hit: the same picture and text again (the prompt's blocks found: neither);
- text only: a prompt of the same length without an image.

It also prints what a decode tier receives for an image in P/D (its span's KV blocks), beside the
pixels and the encoder run that computing the span there would need.

    python bench/images.py [--repeat 5] [--family llava|qwen|gemma] [--model DIR]
"""
from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time

import numpy as np
from PIL import Image

from baton import LLM, SamplingParams
from baton.testing.checkpoints import write_random_gemma3_vl, write_random_llava, write_random_qwen2_5_vl

VISION = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12}
TEXT = {"hidden_size": 512, "intermediate_size": 1408, "num_attention_heads": 8, "num_key_value_heads": 8,
        "num_hidden_layers": 8}
QWEN_VISION = {"depth": 12, "hidden_size": 768, "intermediate_size": 3072, "num_heads": 12,
               "fullatt_block_indexes": [5, 11]}
GEMMA_TEXT = {"head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 512,
              "layer_types": ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2}
QWEN_ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]}}


def ttft(llm: LLM, prompt: dict | list[int]) -> float:
    t0 = time.perf_counter()
    llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--family", choices=("llava", "qwen", "gemma"), default="llava")
    p.add_argument("--model", help="a checkpoint of that family (default: a random one written here)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as scratch:  # the random checkpoint is ~0.5 GB: never left behind
        run(args, scratch)


def run(args: argparse.Namespace, scratch: str) -> None:
    if args.model:
        model = args.model
    elif args.family == "qwen":
        model = write_random_qwen2_5_vl(scratch + "/qwen-vl", seed=1, patch_size=14, window_size=112,
                                        max_pixels=1280 * 28 * 28, vision=QWEN_VISION, text={**TEXT, **QWEN_ROPE})
    elif args.family == "gemma":
        model = write_random_gemma3_vl(scratch + "/gemma3-vl", seed=1, image_size=224, patch_size=16,
                                       tokens_per_image=49, vision=VISION, text={**TEXT, **GEMMA_TEXT})
    else:
        model = write_random_llava(scratch + "/llava", seed=1, image_size=224, patch_size=16,
                                   vision=VISION, text=TEXT)
    llm = LLM(model, dtype="float32", device="cpu")
    images = llm.engine.inputs.images
    image_token, wrap = images.image_token_id, list(llm.engine.core.facts().image_wrap)
    rng = np.random.default_rng(0)
    sample = rng.integers(0, 256, (240, 320, 3), dtype=np.uint8)
    per_image = images.expand([image_token], [sample], "image")[1][0].length
    rows = {"cold": [], "encoder-cache hit": [], "prefix-cache hit": [], "text only": []}
    for _ in range(args.repeat):
        picture = rng.integers(0, 256, (240, 320, 3), dtype=np.uint8)
        texts = [rng.integers(3, 500, 40).tolist() for _ in range(3)]
        image = wrap[:1] + [image_token] + wrap[1:]
        with_image = [{"prompt_token_ids": t[:8] + image + t[8:], "multi_modal_data": {"image": picture}}
                      for t in texts[:2]]
        rows["cold"].append(ttft(llm, with_image[0]))
        rows["encoder-cache hit"].append(ttft(llm, with_image[1]))
        rows["prefix-cache hit"].append(ttft(llm, with_image[0]))
        rows["text only"].append(ttft(llm, texts[2] + rng.integers(3, 500, per_image).tolist()))
    print(f"{llm.engine.runner.model.args.architecture}: {per_image} image tokens for a 320x240 picture, "
          f"language model {TEXT['num_hidden_layers']}x{TEXT['hidden_size']}; prompts of {40 + per_image} tokens; "
          f"median of {args.repeat}")
    cold = statistics.median(rows["cold"])
    for name, times in rows.items():
        median = statistics.median(times)
        print(f"  {name:18s} TTFT {median * 1e3:8.1f} ms   {median / cold:5.2f}x cold")
    runner = llm.engine.runner
    png = io.BytesIO()
    Image.fromarray(picture).save(png, format="PNG")
    reads = []
    for _ in range(args.repeat):  # what a decode given the image's span skips: decoding and processing it
        t0 = time.perf_counter()
        picture_bytes = images.expand([image_token], [png.getvalue()], "image")[1][0].pixels
        reads.append(time.perf_counter() - t0)
    a = runner.model.args  # (every layer's K and V of every token: what a decode pulls, windows aside)
    kv_bytes = a.num_layers * 2 * a.num_kv_heads * a.head_dim * runner.kv_cache.element_size() * per_image
    encoder_s = statistics.median(rows["cold"]) - statistics.median(rows["encoder-cache hit"])
    print(f"  P/D: a decode READs {kv_bytes / 1024:.0f} KiB of KV for an image's span (float32) and runs nothing "
          f"of it; re-encoding there would take {len(picture_bytes) / 1024:.0f} KiB of pixels, {encoder_s:.3f} s "
          f"of encoder here, and the span's prefill")
    print(f"  P/D: a decode given the span skips reading the image: {statistics.median(reads) * 1e3:.1f} ms to decode "
          f"the {len(png.getvalue()) / 1024:.0f} KiB PNG and process it, and {len(picture_bytes) / 1024:.0f} KiB of "
          f"pixels to its core")


if __name__ == "__main__":
    main()
