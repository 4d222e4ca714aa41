"""A listening gRPC server, its health reporting and its drain."""
from __future__ import annotations

import asyncio
import socket

import grpc
from grpc_health.v1 import health_pb2

from baton.services.rpc.names import SERVICE_NAME


def advertised_host(host: str, advertise_host: str | None) -> str:
    """The host peers should dial: the one given, else the listening host, else (listening on
    every interface) the address this host's name resolves to, as a pod's does to its IP."""
    if advertise_host:
        return advertise_host
    if host in ("0.0.0.0", "::", "[::]", ""):
        return socket.gethostbyname(socket.gethostname())
    return host


def make_grpc_server(host: str, port: int, max_message_bytes: int, extra_options: list[tuple] = (),
                     tls=None) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server listening on host:port (0: any free port), over TLS when tls (a
    TLSConfig) is given; returns it and its port."""
    server = grpc.aio.server(options=[("grpc.max_send_message_length", max_message_bytes),
                                      ("grpc.max_receive_message_length", max_message_bytes),
                                      ("grpc.so_reuseport", 0),  # a taken port is an error, not a shared one
                                      *extra_options])
    address = f"{host}:{port}"
    bound = (server.add_secure_port(address, tls.server_credentials()) if tls is not None
             else server.add_insecure_port(address))
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port} (in use?)")
    return server, bound


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
