"""A request's large pixels cross from the front to its engine core as ZMQ frames of their own
(engine/common/pixel_frames.py), never inside the request's msgpack: the request decoded on the
other side is the one sent, its pixels views of the received frames; small images stay inline.
Served end to end, a picture past the threshold gives the offline engine's tokens."""
from __future__ import annotations

import io
import os

import msgspec
import numpy as np
import zmq
from PIL import Image

from baton import LLM, SamplingParams
from baton.engine.common.core_messages import CoreInput, CoreRequest, ImageInput
from baton.engine.common.pixel_frames import ZERO_COPY_BYTES, attach_pixels, request_frames
from baton.engine.common.sampling_params import SamplingParams as CoreSampling
from baton.testing.checkpoints import write_random_llava


def test_large_pixels_travel_as_frames_and_arrive_as_sent():
    rng = np.random.default_rng(0)
    large, small = rng.random((3, 96, 96), dtype=np.float32).tobytes(), rng.random((3, 8, 8), dtype=np.float32)
    request = CoreRequest(3, "r", list(range(40)), CoreSampling(), 1.0, images=[
        ImageInput(11, 2, 9, small.tobytes(), [3, 8, 8]), ImageInput(12, 20, 9, large, [3, 96, 96])])
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(CoreInput)
    frames = request_frames(request, encoder.encode)
    assert len(large) >= ZERO_COPY_BYTES > len(small.tobytes())
    assert len(frames) == 2 and frames[1] is large and len(frames[0]) < len(large)  # the small one inline
    ctx = zmq.Context()
    out, inp = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    out.bind(f"ipc://@baton-test-pixels-{os.getpid()}")
    inp.connect(f"ipc://@baton-test-pixels-{os.getpid()}")
    try:
        out.send_multipart(frames, copy=False)
        got = inp.recv_multipart(copy=False)
        msg = decoder.decode(got[0].buffer)
        attach_pixels(msg, got)
        assert isinstance(msg.images[1].pixels, memoryview)  # a view of the frame, not a copy
        assert msg == request  # (pixel_frames cleared again)
    finally:
        out.close(linger=0)
        inp.close(linger=0)
        ctx.term()


def test_a_served_picture_past_the_threshold_gives_the_offline_tokens(serve, tmp_path):
    import grpc

    from baton.v1 import generate_pb2 as pb
    from baton.v1 import generate_pb2_grpc as pb_grpc

    model = write_random_llava(str(tmp_path / "llava"), seed=4, image_size=128, patch_size=16)  # 192 KiB of pixels
    picture = np.random.default_rng(4).integers(0, 256, (90, 70, 3), dtype=np.uint8)
    llm = LLM(model, dtype="float32", device="cpu")
    image_text = llm.engine.inputs.images.image_text
    ids = llm.engine.inputs.apply_chat_template([{"role": "user", "content": image_text + "What is it?"}])
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": picture}}, greedy)[0].token_ids
    png = io.BytesIO()
    Image.fromarray(picture).save(png, format="PNG")
    srv = serve(model)
    request = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="What is it?",
                                                                       images=[pb.Image(data=png.getvalue())])]),
                                 sampling=pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    with grpc.insecure_channel(srv.address) as channel:
        got = [t for r in pb_grpc.TextGenerationStub(channel).Generate(request, timeout=60) for t in r.token_ids]
    assert got == want
    assert srv.wait_pool_full()
