"""The encoder tier's server (`baton serve --role encoder`, E/P/D): a vision-language model's
image encoder alone behind the internal `Encode` call. It reads a chat's images as an engine
server would (media.py: the same URLs, flags and errors), processes and encodes them
(engine/worker/vision_encoder.py) and holds their embeddings for a prefill to READ over NIXL
(kv_transfer/nixl_embeddings.py); an image it holds already is not encoded again. The router
calls it before the prefill; the prefill reads the embeddings instead of the images."""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from baton.engine.common.config import EngineConfig
from baton.engine.common.errors import InvalidArgument, check
from baton.engine.front.images import ImageProcessor
from baton.kv_transfer.nixl_embeddings import EmbeddingStore, StoredImage, StoreFull
from baton.services.rpc.chat import chat_images
from baton.services.rpc.errors import abort, abort_invalid
from baton.services.rpc.serving import advertised_host, drain, make_grpc_server, set_health
from baton.services.rpc.tls import TLSConfig
from baton.services.server.call_checks import from_stack
from baton.services.server.media import MediaOptions, read_images
from baton.services.telemetry import tracing
from baton.v1 import generate_pb2 as pb
from baton.v1 import internal_pb2, internal_pb2_grpc

log = logging.getLogger("baton.encoder")


@dataclass(slots=True)
class EncoderOptions:
    host: str = "127.0.0.1"
    port: int = 50051  # 0: any free port
    max_message_bytes: int = 16 << 20
    grace_s: float = 10.0
    internal_token: str | None = None  # required in TOKEN_KEY metadata of Encode when set
    slots: int = 64  # images whose embeddings it holds (its encoder cache), each as large as the largest image
    hold_s: float = 30.0  # a slot handed out is not reused for this long, unless its reader said it is done
    engine_id: str | None = None  # the NIXL agent's name; default: encoder + a random suffix
    otlp_traces_endpoint: str | None = None
    served_model_name: str | None = None
    tls: TLSConfig | None = None
    advertise_host: str | None = None
    media: MediaOptions = field(default_factory=MediaOptions)

    def __post_init__(self):
        check(isinstance(self.slots, int) and self.slots >= 1, "encoder_slots", f"must be >= 1, got {self.slots!r}")
        check(self.hold_s > 0, "encoder_hold_timeout", f"must be > 0, got {self.hold_s!r}")


class EncoderService(internal_pb2_grpc.EncoderServicer):
    """Encode, once the model has loaded (`load`). One thread runs the processor and the model:
    requests' images are encoded one request after another."""

    def __init__(self, config: EngineConfig, options: EncoderOptions, engine_id: str, model_name: str, tracer,
                 is_serving):
        """`config`: the model, its dtype and device (an engine's flags; the others are not read);
        `model_name`: in spans."""
        self.config, self.options, self.engine_id, self.model_name = config, options, engine_id, model_name
        self.tracer, self.is_serving = tracer, is_serving
        self.encoder = None  # VisionEncoder, by load()
        self.processor: ImageProcessor | None = None  # the model's, as a prefill's front has it
        self.store: EmbeddingStore | None = None
        self.in_flight = 0  # Encode calls, for the drain
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="encoder")
        self._stop_polling = threading.Event()
        self._poller: threading.Thread | None = None

    def load(self) -> None:
        from baton.engine.common.config import read_config
        from baton.engine.worker.models import model_args
        from baton.engine.worker.vision_encoder import VisionEncoder  # (torch models: seconds)

        o, config = self.options, self.config
        config.resolve_device()
        dtype = config.torch_dtype(model_args(read_config(config.model)).torch_dtype)
        self.encoder = VisionEncoder(config.model, dtype, config.device)
        vision = self.encoder.vision  # (image_text is a prompt's: the encoder writes none)
        self.processor = ImageProcessor(config.model, vision.image_token_id, vision.tokens_per_image,
                                        self.encoder.max_image_tokens, "")
        self.store = EmbeddingStore(self.engine_id, o.slots, self.encoder.max_image_tokens, self.encoder.hidden,
                                    dtype, o.hold_s)
        self._poller = threading.Thread(target=self.store.serve, args=(self._stop_polling,), daemon=True,
                                        name="encoder-nixl")
        self._poller.start()

    async def Encode(self, msg: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.EncodedImages:
        await from_stack(context, self.options.internal_token)
        if not self.is_serving():
            await abort(context, grpc.StatusCode.UNAVAILABLE, "the encoder is loading or draining",
                        pb.FAILURE_REASON_ENGINE_UNAVAILABLE)
        name = internal_pb2.DESCRIPTOR.services_by_name["Encoder"].full_name
        with tracing.ServerSpan(self.tracer, context, f"encode {self.model_name}",
                                tracing.rpc_attributes(name, "Encode")) as span:
            self.in_flight += 1
            work = tracing.start_span(self.tracer, "encode", span)  # (the waterfall's phase: read, process, encode)
            error = None
            try:
                images = await read_images(msg.chat, self.processor, self.options.media)
                fields = [name for name, _ in chat_images(msg.chat)]
                stored = await asyncio.get_running_loop().run_in_executor(self._thread, self._encode, images, fields,
                                                                          msg.request_id)
            except InvalidArgument as e:
                error = str(e)
                await abort_invalid(context, e)
            except StoreFull as e:
                error = str(e)
                await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            finally:
                self.in_flight -= 1
                tracing.end_span(work, attributes={"baton.images": len(chat_images(msg.chat))}, error=error)
            return pb.EncodedImages(encoder_id=self.engine_id, agent_metadata=self.store.agent_metadata,
                                    hold_seconds=self.options.hold_s, images=stored)

    def _encode(self, images: list, fields: list[str], request_id: str) -> list[pb.EncodedImage]:
        """The images processed, those not held encoded, all held for a reader (on the encoder's thread)."""
        started = time.perf_counter()
        processed = [self.processor.processed(image, name) for image, name in zip(images, fields, strict=True)]
        where: dict[int, StoredImage] = {}
        for image in processed:
            if image.digest not in where and (found := self.store.lookup(image.digest)) is not None:
                where[image.digest] = found
        todo = list({i.digest: i for i in processed if i.digest not in where}.values())
        for image, embeds in zip(todo, self.encoder.encode(todo)):
            where[image.digest] = self.store.put(image.digest, embeds)
        log.info("request %s: %d images, %d encoded, %d held already (%.1f ms)", request_id, len(processed),
                 len(todo), len(processed) - len(todo), (time.perf_counter() - started) * 1e3)
        dtype = str(self.store.dtype).removeprefix("torch.")
        return [pb.EncodedImage(span=pb.ImageSpan(digest=i.digest, length=i.length, shape=i.shape),
                                address=where[i.digest].address, nbytes=where[i.digest].nbytes, dtype=dtype,
                                hidden=self.encoder.hidden) for i in processed]

    def close(self) -> None:
        self._stop_polling.set()
        if self._poller is not None:
            self._poller.join()
        self._thread.shutdown()
        if self.store is not None:
            self.store.close()


class EncoderServer:
    """Listens at once (health NOT_SERVING while the model loads), then serves Encode. The same
    surface as the engine server's for `baton serve`: start, stop, address, dead."""

    def __init__(self, config: EngineConfig, options: EncoderOptions):
        self.config, self.options = config, options
        o = options
        self.serving = False
        self.dead = asyncio.Event()  # (never set: the encoder runs in this process)
        self.metrics_server, self.http = None, None
        self.health = health.aio.HealthServicer()
        self.grpc, self.port = make_grpc_server(o.host, o.port, o.max_message_bytes, tls=o.tls)
        self.address = f"{advertised_host(o.host, o.advertise_host)}:{self.port}"
        self.engine_id = o.engine_id or f"encoder-{uuid.uuid4().hex[:12]}"
        self.tracer = tracing.make_tracer("encoder", self.engine_id, o.otlp_traces_endpoint)
        model_name = o.served_model_name or os.path.basename(os.path.normpath(config.model))
        self.service = EncoderService(config, o, self.engine_id, model_name, self.tracer, lambda: self.serving)
        internal_pb2_grpc.add_EncoderServicer_to_server(self.service, self.grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(
            [internal_pb2.DESCRIPTOR.services_by_name["Encoder"].full_name,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], self.grpc)

    async def start(self) -> None:
        await set_health(self.health, False)
        await self.grpc.start()
        await asyncio.to_thread(self.service.load)
        self.serving = True
        await set_health(self.health, True)
        log.info("encoding images of %s on %s (%d slots of %d tokens)", self.config.model, self.address,
                 self.options.slots, self.service.encoder.max_image_tokens)

    async def stop(self, grace_s: float | None = None) -> None:
        self.serving = False
        await set_health(self.health, False)
        await drain(self.grpc, lambda: self.service.in_flight, self.options.grace_s if grace_s is None else grace_s)
        self.service.close()
        tracing.shutdown(self.tracer)

