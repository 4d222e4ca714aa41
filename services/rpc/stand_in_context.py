"""A stand-in for grpc.aio.ServicerContext, for a call that did not come as a gRPC call of its
own (the OpenAI front's HTTP request, a request on the router's stream to a decode): what the
handlers use of a context, the metadata the call came with and the status an abort ended it
with. An abort raises Aborted, as a gRPC handler's abort raises. A DirectContext also takes a
request's responses straight, past its Generate's generator."""
from __future__ import annotations

import grpc

from baton.v1 import generate_pb2 as pb


class Aborted(Exception):
    pass


class StandInContext:
    def __init__(self, metadata: tuple):
        self._metadata = metadata
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self.trailing_metadata: tuple = ()  # the abort's (errors.details: its failure reason and field)

    def invocation_metadata(self):
        return self._metadata

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()):
        self._code, self._details, self.trailing_metadata = code, details, tuple(trailing_metadata)
        raise Aborted(details)

    def code(self):
        return self._code

    def details(self):
        return self._details

    def time_remaining(self):
        return None

    async def send_initial_metadata(self, metadata) -> None:
        pass


class DirectContext(StandInContext):
    """The context of a call whose responses may be handed to it straight, past its Generate's
    generator, in the order the generator's would have gone: once a request alone on the call
    (n of 1) answered its first, the engine server's and the router's sinks give it those but
    the last as they are read, and no coroutine is woken per token (a stream of requests'
    StreamContext, the OpenAI front's event stream)."""

    def respond(self, resp: pb.GenerateResponse | bytes) -> None:
        raise NotImplementedError

    def respond_tokens(self, request_id: str, token_ids: list[int], text: str) -> None:
        """A response with nothing but these (not a request's last)."""
        raise NotImplementedError
