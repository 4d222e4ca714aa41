"""A stand-in for grpc.aio.ServicerContext, for a call that did not come as a gRPC call of its
own (the OpenAI front's HTTP request, a request on the router's stream to a decode): what the
handlers use of a context, the metadata the call came with and the status an abort ended it
with. An abort raises Aborted, as a gRPC handler's abort raises."""
from __future__ import annotations

import grpc


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
