"""A request's pixels on their way from the front to its engine core. An image's pixels of
ZERO_COPY_BYTES or more travel as ZMQ frames of their own, sent from the front's bytes and taken
by the core as views of the received frames, instead of inside the request's msgpack, which
copies every byte into the message and again out of it (bench/ipc.py --pixels)."""
from __future__ import annotations

from collections.abc import Callable

import msgspec

from baton.engine.common.core_messages import CoreRequest

# Below this a copy is cheaper than zero-copy's bookkeeping (pyzmq's own advice is ~64 KB).
ZERO_COPY_BYTES = 65536


def request_frames(request: CoreRequest, encode: Callable[[object], bytes]) -> list:
    """The request as frames: its msgpack without the large images' pixels (naming those images
    in `pixel_frames`), then those pixels, one frame each."""
    large = [i for i, image in enumerate(request.images) if len(image.pixels) >= ZERO_COPY_BYTES]
    if not large:
        return [encode(request)]
    images = [msgspec.structs.replace(image, pixels=b"") if i in large else image
              for i, image in enumerate(request.images)]
    light = msgspec.structs.replace(request, images=images, pixel_frames=large)
    return [encode(light), *(request.images[i].pixels for i in large)]


def attach_pixels(request: CoreRequest, frames: list) -> None:
    """Give a request decoded from frames[0] its images' pixels from the frames after it (each a
    memoryview of a received frame: no copy)."""
    for index, frame in zip(request.pixel_frames, frames[1:], strict=True):
        request.images[index].pixels = frame.buffer
    request.pixel_frames = []
