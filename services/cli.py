"""The `baton` command line."""
from __future__ import annotations

import argparse
import os
import sys
import time

DEFAULT_MODELS_DIR = os.environ.get("BATON_MODELS_DIR", "models")
DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
]


def _prepare(args) -> None:
    from baton.engine.checkpoints import prepare_models

    t0 = time.perf_counter()
    paths = prepare_models(args.models_dir)
    for name, path in paths.items():
        print(f"{name:>10}: {path}")
    print(f"ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr)


def _generate(args) -> None:
    from baton import LLM, SamplingParams
    from baton.engine.checkpoints import SMOLLM2_DIR_NAME

    model = args.model or os.path.join(args.models_dir, SMOLLM2_DIR_NAME)
    llm = LLM(model, device=args.device, dtype=args.dtype)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    questions = args.prompt or DEMO_QUESTIONS
    t0 = time.perf_counter()
    if llm.tokenizer.chat_template and not args.raw:
        outputs = llm.chat([[{"role": "user", "content": q}] for q in questions], params)
    else:
        outputs = llm.generate(questions, params)
    elapsed = time.perf_counter() - t0
    for q, out in zip(questions, outputs):
        print(f"> {q}\n{out.text.strip()}\n  [{len(out.token_ids)} tokens, finish={out.finish_reason}]\n")
    total = sum(len(o.token_ids) for o in outputs)
    print(f"{total} tokens in {elapsed:.2f}s ({total / elapsed:.1f} tok/s)", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="baton", description="Baton: disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare-models", help="write the demo model and the tiny test checkpoints")
    p.add_argument("--models-dir", default=DEFAULT_MODELS_DIR)
    p.set_defaults(func=_prepare)
    g = sub.add_parser("generate", help="run the offline engine on a checkpoint and print the answers")
    g.add_argument("prompt", nargs="*", help="questions (default: a few demo questions)")
    g.add_argument("--model", help="HF checkpoint directory (default: the prepared SmolLM2)")
    g.add_argument("--models-dir", default=DEFAULT_MODELS_DIR)
    g.add_argument("--device", default="auto")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--raw", action="store_true", help="send prompts as plain text, without the chat template")
    g.set_defaults(func=_generate)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
