"""A listening gRPC server, the public service on it, its health reporting and its drain."""
from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2

from baton.services.rpc.call_responses import per_call
from baton.services.rpc.names import SERVICE_NAME
from baton.v1 import generate_pb2 as pb


def free_port(host: str) -> int:
    """A port nobody listens on now (a process started later binds it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def advertised_host(host: str, advertise_host: str | None) -> str:
    """The host peers should dial: the one given, else the listening host, else (listening on
    every interface) the address this host's name resolves to, as a pod's does to its IP."""
    if advertise_host:
        return advertise_host
    if host in ("0.0.0.0", "::", "[::]", ""):
        return socket.gethostbyname(socket.gethostname())
    return host


def make_grpc_server(host: str, port: int, max_message_bytes: int, extra_options: list[tuple] = (),
                     tls=None, reuse_port: bool = False, also: tuple[str, ...] = ()) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server listening on host:port (0: any free port), over TLS when tls (a
    TLSConfig) is given; returns it and its port. `reuse_port`: share the port with other
    processes that do (router workers); else a taken port is an error. `also`: more HOST:PORT
    to listen on."""
    server = grpc.aio.server(options=[("grpc.max_send_message_length", max_message_bytes),
                                      ("grpc.max_receive_message_length", max_message_bytes),
                                      ("grpc.so_reuseport", int(reuse_port)), *extra_options])
    bound = 0
    for address in (f"{host}:{port}", *also):
        got = (server.add_secure_port(address, tls.server_credentials()) if tls is not None
               else server.add_insecure_port(address))
        if got == 0:
            raise OSError(f"cannot listen on {address} (in use?)")
        bound = bound or got
    return server, bound


class RuntimeApi(Protocol):
    """baton.v1.TextGeneration but Generate: the runtime API, a unit of its own beside Generate
    in an engine server (engine_runtime_api.py) and in the router (router_runtime_api.py)."""

    async def GetModelInfo(self, msg: pb.GetModelInfoRequest, context) -> pb.ModelInfo: ...
    async def GetLoad(self, msg: pb.GetLoadRequest, context) -> pb.Load: ...
    def WatchLoad(self, msg: pb.GetLoadRequest, context) -> AsyncIterator[pb.Load]: ...
    async def Abort(self, msg: pb.AbortRequest, context) -> pb.AbortResponse: ...
    async def Tokenize(self, msg: pb.TokenizeRequest, context) -> pb.TokenizeResponse: ...
    async def Detokenize(self, msg: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse: ...
    async def LoadAdapter(self, msg: pb.LoadAdapterRequest, context) -> pb.Adapter: ...
    async def UnloadAdapter(self, msg: pb.UnloadAdapterRequest, context) -> pb.Adapter: ...
    async def ListAdapters(self, msg: pb.ListAdaptersRequest, context) -> pb.ListAdaptersResponse: ...


def add_text_generation(server: grpc.aio.Server, generate: Callable[..., AsyncIterator], runtime: RuntimeApi,
                        generate_serialized: bool = False) -> None:
    """Serve baton.v1.TextGeneration from its two units: `generate` answers Generate (as a call of
    its own runs it: call_responses.per_call), `runtime` every other method. gRPC takes one
    servicer per service, so the method table is built here from both. `generate_serialized`:
    Generate yields its responses as bytes already (the router passes a backend's through)."""
    behaviours = {"Generate": per_call(generate, generate_serialized), "GetModelInfo": runtime.GetModelInfo,
                  "GetLoad": runtime.GetLoad, "WatchLoad": runtime.WatchLoad, "Abort": runtime.Abort,
                  "Tokenize": runtime.Tokenize, "Detokenize": runtime.Detokenize, "LoadAdapter": runtime.LoadAdapter,
                  "UnloadAdapter": runtime.UnloadAdapter, "ListAdapters": runtime.ListAdapters}
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["TextGeneration"].methods:
        if method.name not in behaviours:  # the proto gained a method: it needs a unit to answer it
            raise TypeError(f"{SERVICE_NAME}/{method.name}: no unit answers it (add it to add_text_generation)")
        request, response = getattr(pb, method.input_type.name), getattr(pb, method.output_type.name)
        serialize = None if generate_serialized and method.name == "Generate" else response.SerializeToString
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(behaviours[method.name], request_deserializer=request.FromString,
                                     response_serializer=serialize)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)])
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


async def set_health(servicer, serving: bool) -> None:
    """Report SERVING or NOT_SERVING, for the whole server and for the API's service."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE_NAME):
        await servicer.set(name, status)


def in_background(tasks: set[asyncio.Task], coro) -> None:
    """Run coro as a task that stays referenced until done (asyncio keeps only weak ones)."""
    task = asyncio.ensure_future(coro)
    tasks.add(task)
    task.add_done_callback(tasks.discard)


async def drain(server: grpc.aio.Server, num_in_flight, grace_s: float) -> None:
    """Give in-flight requests up to grace_s to finish, then stop the server, cancelling what
    is left. grpc's own grace would also wait for long-lived calls that never end by
    themselves (a router's health Watch), so the wait counts requests instead."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while num_in_flight() and loop.time() < deadline:
        await asyncio.sleep(0.05)
    await server.stop(0)
