"""A stand-in for grpc.aio.ServicerContext, for a call that did not come as a gRPC call of its
own (the OpenAI front's HTTP request, a request on the router's stream to a decode): what the
handlers use of a context, the metadata the call came with and the status an abort ended it
with. An abort raises Aborted, as a gRPC handler's abort raises. A DirectContext also takes a
request's responses straight, past its Generate's generator (as a gRPC call's CallResponses
does beside its context: `responses_of`)."""
from __future__ import annotations

from typing import Protocol

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


class Responses(Protocol):
    """Where a request's responses may be handed straight, past its Generate's generator, in the
    order the generator's would have gone: once a request alone on its call (n of 1) answered
    its first, the engine server's and the router's sinks give it those but the last as they are
    read, and no coroutine is woken per token (a DirectContext; a gRPC call's CallResponses)."""

    def respond(self, resp: pb.GenerateResponse | bytes) -> None: ...

    def respond_tokens(self, request_id: str, token_ids: list[int], text: str) -> None:
        """A response with nothing but these (not a request's last)."""


def responses_of(context, responses: Responses | None) -> Responses | None:
    """Where a Generate's request may hand its responses straight: the call's own (a gRPC call's),
    else its context where that takes them (None: they go through the generator)."""
    return responses if responses is not None else context if isinstance(context, DirectContext) else None


class DirectContext(StandInContext):
    """A stand-in context that takes its request's responses straight (Responses): a stream of
    requests' StreamContext, the OpenAI front's event stream."""

    def respond(self, resp: pb.GenerateResponse | bytes) -> None:
        raise NotImplementedError

    def respond_tokens(self, request_id: str, token_ids: list[int], text: str) -> None:
        """A response with nothing but these (not a request's last)."""
        raise NotImplementedError
