"""`baton generate`: stream an answer from a server, or run the engine in this process."""
from __future__ import annotations

import sys
import time

DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
]


def generate(args, engine_config, tls) -> None:
    """With --target, stream from a server; without, run the offline engine in this process."""
    if args.target:
        _generate_remote(args, tls(args))
    else:
        _generate_offline(args, engine_config(args))


def _generate_remote(args, tls) -> None:
    import grpc

    from baton.services.client import Client

    prompt = " ".join(args.prompt) or DEMO_QUESTIONS[0]
    if not args.raw:
        prompt = [{"role": "user", "content": prompt}]
    t0, n = time.perf_counter(), 0
    with Client(args.target, tls=tls) as client:
        try:
            for chunk in client.generate(prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                                         seed=args.seed, timeout=args.timeout):
                print(chunk.text, end="", flush=True)
                n += len(chunk.token_ids)
                if chunk.finish_reason:
                    print(f"\n  [{n} tokens in {time.perf_counter() - t0:.2f}s, finish={chunk.finish_reason}]",
                          file=sys.stderr)
        except grpc.RpcError as e:
            sys.exit(f"\nbaton generate: {e.code().name}: {e.details()}")


def _generate_offline(args, config) -> None:
    from baton import LLM, SamplingParams

    llm = LLM(config)
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
