"""What one step's output costs to cross from the engine core to its front: encoding and
decoding a CoreStep of N requests' outputs with msgspec (what Baton uses) and with pickle 5,
and a round trip of that message over ZMQ PUSH/PULL on abstract-namespace IPC. Then what a
request's image costs on its way from the front to the core: its pixels inside the request's
msgpack, against in frames of their own (engine/common/pixel_frames.py), encoded, sent,
received and decoded, for a LLaVA-1.5 picture (336 px), a Qwen2.5-VL picture of 320x240 and the
largest Qwen2.5-VL's processor makes (max_pixels 1280 x 28 x 28).

    .venv/bin/python bench/ipc.py --requests 64
"""
from __future__ import annotations

import argparse
import math
import os
import pickle
import statistics
import threading
import time

import msgspec
import zmq

from baton.engine.common.core_messages import (
    CoreInput,
    CoreMessage,
    CoreOutput,
    CoreRequest,
    CoreStep,
    ImageInput,
    TokenLogprobs,
)
from baton.engine.common.pixel_frames import attach_pixels, request_frames
from baton.engine.common.sampling_params import SamplingParams


def step(num_requests: int, logprobs: bool) -> CoreStep:
    def lp(i: int):  # a list of its own per request: pickle would send a shared one once
        return [TokenLogprobs(i, -0.25 - i, 1, [i, 4, 9, 230, 5], [-0.25 - i, -1.5, -2.0, -2.25, -3.0])]

    return CoreStep([CoreOutput(key=i, new_token_ids=[1000 + i], logprobs=lp(i) if logprobs else None)
                     for i in range(num_requests)],
                    time=time.monotonic(), num_waiting=3, num_received=num_requests)


def per_call_us(fn, n: int) -> float:
    best = float("inf")
    for _ in range(5):  # the fastest of five runs: the machine's noise only ever adds
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e6


def round_trip_us(payload: bytes, n: int) -> float:
    """Median time for a message to go to an echo thread and back, over two PUSH/PULL pairs."""
    ctx = zmq.Context()
    name = f"ipc://@baton-bench-ipc-{os.getpid()}"
    out, back = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    out.bind(name + "-in")
    back.bind(name + "-out")

    def echo() -> None:
        inp, ret = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        inp.connect(name + "-in")
        ret.connect(name + "-out")
        for _ in range(n):
            ret.send(inp.recv(copy=False), copy=False)
        inp.close()
        ret.close()

    thread = threading.Thread(target=echo)
    thread.start()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        out.send(payload)
        back.recv()
        times.append(time.perf_counter() - t)
    thread.join()
    out.close()
    back.close()
    ctx.term()
    return statistics.median(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=64, help="requests with a new token in the step")
    p.add_argument("--iterations", type=int, default=2000)
    args = p.parse_args()
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(CoreMessage)
    print(f"{'message':<46}{'bytes':>8}{'encode µs':>11}{'decode µs':>11}{'ZMQ round trip µs':>19}")
    for logprobs in (False, True):
        msg = step(args.requests, logprobs)
        label = f"CoreStep, {args.requests} outputs" + (", 5 logprobs" if logprobs else "")
        for name, enc, dec in (("msgspec", encoder.encode, decoder.decode),
                               ("pickle 5", lambda m: pickle.dumps(m, protocol=5), pickle.loads)):
            raw = enc(msg)
            assert dec(raw) == msg, name
            encode_us = per_call_us(lambda enc=enc, msg=msg: enc(msg), args.iterations)
            decode_us = per_call_us(lambda dec=dec, raw=raw: dec(raw), args.iterations)
            print(f"{label + ' (' + name + ')':<46}{len(raw):>8}{encode_us:>11.1f}{decode_us:>11.1f}"
                  f"{round_trip_us(raw, args.iterations):>19.1f}")

    print(f"\n{'an image to the core':<46}{'bytes':>11}{'inline ms':>11}{'frames ms':>11}")
    for label, shape in (("LLaVA-1.5, 336 px", [3, 336, 336]), ("Qwen2.5-VL, 320x240", [1, 18, 22, 1176]),
                         ("Qwen2.5-VL, max_pixels", [1, 64, 80, 1176])):
        inline, frames = image_hop_ms(shape, False), image_hop_ms(shape, True)
        print(f"{label:<46}{4 * math.prod(shape):>11}{inline:>11.2f}{frames:>11.2f}")


def image_hop_ms(shape: list[int], frames: bool, n: int = 20) -> float:
    """The fastest of n: a request with one image of `shape` float32 pixels encoded and sent over
    ZMQ, received and decoded (both ends in this thread)."""
    import numpy as np

    pixels = np.random.default_rng(0).random(shape, dtype=np.float32).tobytes()
    request = CoreRequest(1, "r", list(range(100)), SamplingParams(), time.monotonic(),
                          images=[ImageInput(7, 10, 99, pixels, shape)])
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(CoreInput)
    ctx = zmq.Context()
    name = f"ipc://@baton-bench-pixels-{os.getpid()}"
    out, inp = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    out.setsockopt(zmq.SNDHWM, 0)
    inp.setsockopt(zmq.RCVHWM, 0)
    out.bind(name)
    inp.connect(name)
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        if frames:
            out.send_multipart(request_frames(request, encoder.encode), copy=False)
            got = inp.recv_multipart(copy=False)
            msg = decoder.decode(got[0].buffer)
            attach_pixels(msg, got)
        else:
            out.send(encoder.encode(request), copy=False)
            msg = decoder.decode(inp.recv(copy=False).buffer)
        best = min(best, time.perf_counter() - t)
        assert len(msg.images[0].pixels) == len(pixels)
    out.close()
    inp.close()
    ctx.term()
    return best * 1e3


if __name__ == "__main__":
    main()
