"""Asking a server how it is, synchronously (launcher, probes, tests): the gRPC health
protocol, and the router's view of its backends."""
from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.services.rpc.tls import sync_channel
from baton.v1 import generate_pb2 as pb
from baton.v1 import generate_pb2_grpc


def is_serving(address: str, timeout_s: float = 1.0, tls=None, service: str = "") -> bool:
    """Whether the server at address reports SERVING for `service` (unreachable counts as not)."""
    with sync_channel(address, tls) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                             timeout=timeout_s)
        except grpc.RpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def backend_health(address: str, tls=None) -> list[bool] | None:
    """Whether each backend the router at address lists is healthy in its view (an engine lists
    none); None when it does not answer. A router serves once one decode is healthy, and its
    view of the rest lags the backends' own health by a watch."""
    with sync_channel(address, tls) as channel:
        try:
            load = generate_pb2_grpc.TextGenerationStub(channel).GetLoad(pb.GetLoadRequest(), timeout=2)
        except grpc.RpcError:
            return None
    return [b.healthy for b in load.backends]
