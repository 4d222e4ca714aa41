"""A request's images at an engine server when the router sent them through an encoder tier
(E/P/D): the encoder's embeddings, read over NIXL (kv_transfer/nixl_embeddings.py) into images
the core takes as they are (ImageInput.encoded); where they cannot be read (the encoder gone, its
hold over, counts that do not match the chat), the images themselves, read and decoded as
without an encoder (media.py), and the server encodes them. The front imports NIXL and torch (the
reader's, kv_transfer/nixl_embeddings.py) at the first request that carries embeddings, not
before: a server without an encoder tier never loads them in its front."""
from __future__ import annotations

import asyncio
import logging
import threading

from baton.engine.common.core_messages import ImageInput
from baton.engine.front.images import ImageProcessor
from baton.services.rpc.chat import chat_images
from baton.services.server.media import MediaOptions, read_images
from baton.v1 import generate_pb2 as pb

log = logging.getLogger("baton.server")
MAX_READ_S = 10.0  # a READ's time at most (within 90% of the encoder's hold)


class ChatImages:
    def __init__(self, engine_id: str, media: MediaOptions):
        self.name, self.media = f"{engine_id}-images", media
        self._reader = None  # nixl_embeddings.EmbeddingReader, at the first embeddings
        self._lock = threading.Lock()

    async def of(self, msg: pb.GenerateRequest, processor: ImageProcessor | None) -> list:
        """The chat's images: ImageInputs of the encoder's embeddings, where the request carries
        them and they can be read; else decoded images (media.py), errors naming their fields."""
        if msg.HasField("encoded_images") and processor is not None:
            from baton.kv_transfer.nixl_embeddings import EmbeddingsUnavailable  # (torch and NIXL: see above)

            try:
                return await asyncio.to_thread(self._embeddings, msg, processor.max_image_tokens)
            except EmbeddingsUnavailable as e:
                log.warning("request %s: the encoder's embeddings could not be read (%s); reading its images",
                            msg.request_id, e)
        return await read_images(msg.chat, processor, self.media)

    def _embeddings(self, msg: pb.GenerateRequest, max_image_tokens: int) -> list[ImageInput]:
        encoded = msg.encoded_images
        count = len(chat_images(msg.chat))
        from baton.kv_transfer.nixl_embeddings import EmbeddingReader, EmbeddingsUnavailable

        if len(encoded.images) != count or count > self.media.limit_images:
            raise EmbeddingsUnavailable(f"{len(encoded.images)} embeddings for the chat's {count} images")
        too_long = next((i.span.length for i in encoded.images if i.span.length > max_image_tokens), None)
        if too_long is not None:
            raise EmbeddingsUnavailable(f"an image of {too_long} tokens, more than this engine's {max_image_tokens}")
        with self._lock:
            if self._reader is None:
                self._reader = EmbeddingReader(self.name)
        timeout = min(MAX_READ_S, 0.9 * encoded.hold_seconds) if encoded.hold_seconds > 0 else MAX_READ_S
        values = self._reader.read(encoded.encoder_id, encoded.agent_metadata,
                                   [(i.span.digest, i.address, i.nbytes, i.dtype, i.span.length, i.hidden)
                                    for i in encoded.images], timeout)
        return [ImageInput(i.span.digest, 0, i.span.length, v.numpy().tobytes(), list(i.span.shape), [], True)
                for i, v in zip(encoded.images, values, strict=True)]

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
