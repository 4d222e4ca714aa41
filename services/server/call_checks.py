"""What a call must pass before an engine server serves it: the stack's token on internal
calls, an engine core that has loaded, a server taking requests. Each check that fails aborts
the call with the status (and failure reason) its caller decides on."""
from __future__ import annotations

from collections.abc import Callable

import grpc

from baton.engine.front.core_client import CoreClient
from baton.services.rpc.errors import abort
from baton.services.rpc.names import TOKEN_KEY
from baton.v1 import generate_pb2 as pb


async def from_stack(context: grpc.aio.ServicerContext, token: str | None) -> None:
    """Internal calls must come from the stack: the shared token, when one is configured
    (PERMISSION_DENIED otherwise)."""
    if token is not None and dict(context.invocation_metadata() or ()).get(TOKEN_KEY) != token:
        await abort(context, grpc.StatusCode.PERMISSION_DENIED, f"internal call without the stack's {TOKEN_KEY}")


class CallChecks:
    """`is_serving`: whether the server takes requests now (between its start and its drain)."""

    def __init__(self, core: CoreClient, internal_token: str | None, is_serving: Callable[[], bool]):
        self._core = core
        self._token = internal_token
        self._is_serving = is_serving

    async def from_stack(self, context: grpc.aio.ServicerContext) -> None:
        """Internal calls must come from the stack: the shared token, when one is configured."""
        await from_stack(context, self._token)

    async def loaded(self, context: grpc.aio.ServicerContext) -> None:
        """UNAVAILABLE while the engine core loads the model."""
        if self._core.facts is None:
            await abort(context, grpc.StatusCode.UNAVAILABLE, "the server is loading",
                        pb.FAILURE_REASON_ENGINE_UNAVAILABLE)

    async def internal(self, context: grpc.aio.ServicerContext) -> None:
        """An internal call that needs the engine: from the stack, and once it has loaded."""
        await self.from_stack(context)
        await self.loaded(context)

    async def serving(self, context: grpc.aio.ServicerContext) -> None:
        """A request for the engine: UNAVAILABLE before the server serves and once it drains."""
        if not self._is_serving():
            await abort(context, grpc.StatusCode.UNAVAILABLE, "the server is loading or draining",
                        pb.FAILURE_REASON_ENGINE_UNAVAILABLE)
