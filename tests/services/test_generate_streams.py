"""Many Generate requests on one stream (GenerateStreams), as the router sends a decode's and a
client with multiplex=True sends its own: each request reads as its own Generate call would
(responses, status with its failure details, cancel, deadline, the stack's token per request)
while the server answers them all in a message per step; a router without it (--no-multiplex)
streams the same. A prefill's Prefill calls go on a stream of their own (Prefill/Streams)."""
from __future__ import annotations

import asyncio
import contextlib
import random
import time

import grpc
import pytest
from helpers import TOKEN, greedy_through, pools_full, random_prompts, stats, wait_serving
from servers import ServerProcess

from baton import LLM, SamplingParams
from baton.services.cli.main import _router_options, build_parser
from baton.services.client import AsyncClient
from baton.services.rpc.errors import failure_of_error
from baton.services.rpc.frames import FrameBuffer, FrameError, FramesOpener, FramesServer, frame
from baton.services.rpc.generate_streams import GenerateStreams, _Outbox
from baton.services.rpc.names import (
    PREFILL_METHOD,
    PREFILL_STREAMS_METHOD,
    STREAMS_METHOD,
    STREAMS_VERSION,
    token_metadata,
)
from baton.services.rpc.request_streams import RequestStreams, deliver_batch
from baton.services.rpc.tls import aio_channel
from baton.v1 import generate_pb2 as pb
from baton.v1 import generate_pb2_grpc, internal_pb2, internal_pb2_grpc


def request(prompt: list[int], max_tokens: int, request_id: str = "", **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=prompt), output=pb.OUTPUT_TOKEN_IDS,
                              sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                         **sampling))


async def read(call) -> list[int]:
    ids = []
    async for raw in call:
        ids += pb.GenerateResponse.FromString(raw).token_ids
    return ids


@contextlib.asynccontextmanager
async def serving(add_servicer):
    """An in-process gRPC server on 127.0.0.1 with what add_servicer(server) adds: its address."""
    server = grpc.aio.server()
    add_servicer(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


@contextlib.asynccontextmanager
async def streams_at(address: str, open_streams=lambda channel: RequestStreams(channel, None),
                     frames: int = internal_pb2.FRAMES_SERVICE_UNSPECIFIED):
    """A caller's stream of requests to `address` (a GenerateStreams by default), closed after;
    with `frames` (a FramesService), over the server's frames listener, as the router opens it."""
    channel = aio_channel(address, None)
    streams = open_streams(channel)
    if frames:
        info = await generate_pb2_grpc.TextGenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert info.frames_port, "the server listens for frames by default"
        streams.frames = FramesOpener("127.0.0.1", info.frames_port, frames)
    try:
        yield streams
    finally:
        streams.close()
        await channel.close()


TRANSPORTS = {"grpc": internal_pb2.FRAMES_SERVICE_UNSPECIFIED, "frames": internal_pb2.FRAMES_SERVICE_GENERATE}


def greedy(model: str, prompts, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in LLM(model, dtype="float32", device="cpu").generate(prompts, params)]


@pytest.fixture(scope="module")
def server(tiny_llama):
    proc = ServerProcess(tiny_llama, "--internal-token", TOKEN)
    try:
        proc.address  # noqa: B018 - wait until it serves
        yield proc
    finally:
        proc.stop()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_requests_on_one_stream_read_as_their_own_calls_in_a_message_per_step(server, tiny_llama, transport):
    """Over gRPC and over frames alike (the router's carrier to an engine that listens for them)."""
    prompts = random_prompts([9, 33, 17, 60, 24, 41, 5, 12], seed=201)
    want = greedy(tiny_llama, prompts, 24)

    async def go():
        async with streams_at(server.address, frames=TRANSPORTS[transport]) as streams:
            calls = [streams.open(request(p, 24), (("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01"),), None)
                     for p in prompts]
            # Beside them: one cancelled after its first token, one past its deadline, one the
            # server refuses naming the field, one with a field only the stack may set and no
            # token. None of them touches the others.
            cancelled = streams.open(request(prompts[0], 400), (), None)
            late = streams.open(request(prompts[1], 400), (), 0.3)
            bad = streams.open(request(prompts[2], 8, top_p=2.0), (), None)
            foreign = request(prompts[3], 8)
            foreign.kv_handle.request_id = "not-the-stacks"
            outsider = streams.open(foreign, (), None)
            await cancelled.__aiter__().__anext__()
            cancelled.cancel()
            errors, late_ids = [], []
            for call in (late, bad, outsider):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for raw in call:  # (the late one's tokens until its deadline)
                        late_ids += pb.GenerateResponse.FromString(raw).token_ids
                errors.append(err.value)
            got = await asyncio.gather(*(read(c) for c in calls))
            assert (streams.frames is not None) == (transport == "frames")  # (a failed frames stream unsets it)
            return got, len(late_ids), streams.messages_read, errors, cancelled.done()

    got, late_tokens, messages, (late, bad, outsider), cancelled_done = asyncio.run(asyncio.wait_for(go(), 120))
    assert got == want
    # The requests' tokens shared the messages (a message each would be one per token and more;
    # how many share one depends on the machine's speed: the late one streams alone for its last
    # steps, a message per token, so its tokens are counted too).
    assert messages < sum(len(ids) for ids in got) + late_tokens
    assert late.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and failure_of_error(bad).field == "sampling.top_p"
    assert outsider.code() == grpc.StatusCode.PERMISSION_DENIED
    assert cancelled_done
    assert pools_full(server.address)


@pytest.mark.parametrize("transport", ["grpc", "frames"])
def test_a_client_multiplexing_through_the_router_streams_as_with_calls(tiny_llama, transport):
    """Through a router in front of a prefill and a decode, a client's requests on one stream (and
    the router's to the decode on another) equal the offline engine; one left early is cancelled
    at both tiers. Over gRPC and over the router's frames listener alike (the client library's
    default, the router's ModelInfo saying where)."""
    prefill = ServerProcess(tiny_llama, "--role", "prefill", "--internal-token", TOKEN)
    decode = ServerProcess(tiny_llama, "--role", "decode", "--internal-token", TOKEN)
    router = ServerProcess(tiny_llama, "--role", "router", "--internal-token", TOKEN,
                           "--prefill", prefill.address, "--decode", decode.address)
    prompts = random_prompts([21, 8, 47, 30, 16, 39], seed=203)
    want = greedy(tiny_llama, prompts, 16)

    async def go():
        async with AsyncClient(router.address, multiplex=True, frames=transport == "frames") as client:
            async def collect(prompt):
                return [t async for c in client.generate(prompt, max_tokens=16, temperature=0.0, ignore_eos=True)
                        for t in c.token_ids]

            async def leave_early():
                async for _ in client.generate(prompts[0], max_tokens=400, temperature=0.0, ignore_eos=True):
                    break

            async def texts(prompt):  # the text alone, and beside the ids (both packed once past the first)
                both, alone, ids_with_text, request_ids = "", "", [], set()
                async for c in client.generate(prompt, max_tokens=16, temperature=0.0, ignore_eos=True):
                    both += c.text
                    request_ids.add(c.request_id)  # (the router's, on every chunk: none was given)
                async for c in client.generate(prompt, max_tokens=16, temperature=0.0, ignore_eos=True,
                                               output="text"):
                    alone += c.text
                    ids_with_text += c.token_ids
                assert len(request_ids) == 1 and "" not in request_ids, request_ids
                return both, alone, ids_with_text

            got = await asyncio.gather(*(collect(p) for p in prompts), leave_early())
            text = await asyncio.gather(*(texts(p) for p in prompts[:3]))
            return got[:-1], client.streams.messages_read, text, client.streams.frames

    try:
        wait_serving(router.address)
        got, messages, text, frames = asyncio.run(asyncio.wait_for(go(), 120))
        assert (frames is not None) == (transport == "frames")  # (a frames stream that failed unsets it)
        assert got == want
        assert messages < sum(len(ids) for ids in got)
        assert all(both == alone and both and not ids for both, alone, ids in text)
        assert pools_full(prefill.address) and pools_full(decode.address)
    finally:
        for proc in (router, decode, prefill):
            proc.stop()


def test_a_router_with_a_call_per_request_streams_the_same(server, tiny_llama):
    args = build_parser().parse_args(["serve", "--role", "router", "--decode", server.address, "--no-multiplex"])
    assert _router_options(args).multiplex is False
    assert _router_options(build_parser().parse_args(["serve", "--role", "router", "--decode", "h:1"])).multiplex
    prompts = random_prompts([14, 50, 7, 29], seed=202)
    router = ServerProcess(tiny_llama, "--role", "router", "--internal-token", TOKEN, "--decode", server.address,
                           "--no-multiplex")
    try:
        wait_serving(router.address)
        assert greedy_through(router.address, prompts, 12) == greedy(tiny_llama, prompts, 12)
    finally:
        router.stop()
    assert pools_full(server.address)


async def raw_stream(address: str, messages: list[pb.StreamCommand], metadata: tuple):
    """GenerateStreams spoken by hand: these command messages, then every message read until the
    server ends the stream, and its initial metadata."""
    channel = aio_channel(address, None)
    try:
        method = channel.stream_stream(STREAMS_METHOD, request_serializer=pb.StreamCommand.SerializeToString,
                                       response_deserializer=pb.StreamEvents.FromString)
        call = method(iter(messages), metadata=metadata)
        batches = [batch async for batch in call]
        return batches, tuple(await call.initial_metadata())
    finally:
        await channel.close()


def responses_by_stream(batches: list[pb.StreamEvents]) -> dict[int, list[pb.GenerateResponse]]:
    """Each request's responses, read as RequestStreams reads a message (events, then tokens)."""
    got: dict[int, list[pb.GenerateResponse]] = {}

    class Reader:
        def __init__(self, stream):
            self.stream = stream

        def deliver(self, event):
            if event.HasField("response"):
                got.setdefault(self.stream, []).append(pb.GenerateResponse.FromString(event.response))

        def deliver_tokens(self, token_ids, text):
            got.setdefault(self.stream, []).append(pb.GenerateResponse(token_ids=token_ids, text=text))

    readers = {stream: Reader(stream) for stream in range(1, 100)}
    for batch in batches:
        deliver_batch(batch, readers)
    return got


def test_callers_of_either_version_read_the_same_responses(server, tiny_llama):
    """A caller of version 2 gets the responses between a request's first and last as
    StreamTokens and may send its commands batched; one that does not say so (an older one)
    gets every response as an event. Both read the same token ids and text."""
    prompts = random_prompts([13, 40, 7, 26, 19], seed=204)
    want = greedy(tiny_llama, prompts, 20)

    def opens(output: int) -> list[pb.StreamCommand]:
        commands = []
        for i, prompt in enumerate(prompts):
            msg = request(prompt, 20)
            msg.output = output
            commands.append(pb.StreamCommand(stream=i + 1, open=pb.StreamOpen(request=msg)))
        return commands

    for output in (pb.OUTPUT_TOKEN_IDS, pb.OUTPUT_TEXT_AND_TOKEN_IDS):
        old, old_headers = asyncio.run(raw_stream(server.address, opens(output), ()))
        first, *more = opens(output)
        first.more.extend(more)  # all in one message
        new, new_headers = asyncio.run(raw_stream(server.address, [first], (STREAMS_VERSION,)))
        assert STREAMS_VERSION in old_headers and STREAMS_VERSION in new_headers
        assert not any(batch.HasField("tokens") for batch in old)
        assert sum(len(batch.tokens.streams) for batch in new) > len(prompts) * 10
        old_got, new_got = responses_by_stream(old), responses_by_stream(new)
        for got in (old_got, new_got):
            assert [[t for r in got[i + 1] for t in r.token_ids] for i in range(len(prompts))] == want
        for i in range(len(prompts)):
            assert "".join(r.text for r in new_got[i + 1]) == "".join(r.text for r in old_got[i + 1])
            assert new_got[i + 1][-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert pools_full(server.address)


def test_a_request_s_events_never_follow_its_tokens_in_one_message():
    """Responses added to a stream's outbox in any interleaving (events, tokens, statuses) are
    read back in each request's order: an event of a request that has tokens in the open
    message starts the next message."""
    async def go():
        rng = random.Random(205)
        outbox = _Outbox(compact=True)
        sent: dict[int, list[pb.GenerateResponse]] = {}
        batches = []
        for n in range(400):
            stream = rng.randrange(1, 6)
            resp = pb.GenerateResponse(token_ids=[n, n + 1][:rng.randrange(1, 3)], text=rng.choice(["", f"t{n}"]))
            if rng.random() < 0.4:
                outbox.add(stream, response=resp.SerializeToString())
            else:
                outbox.add_tokens(stream, list(resp.token_ids), resp.text)
            sent.setdefault(stream, []).append(resp)
            if rng.random() < 0.1:
                batches += await outbox.take()
        batches += await outbox.take()
        return sent, batches

    sent, batches = asyncio.run(go())
    assert len(batches) > 40  # (a message sealed by an event, as well as those taken)
    assert responses_by_stream(batches) == sent


def test_a_carrier_that_cannot_write_gets_what_its_requests_answered_merged_once_it_can():
    """Over frames, a caller that reads too slowly pauses the connection (asyncio's flow control):
    what its requests answer meanwhile waits in one message, which goes once it can write again;
    the stream's last statuses go whatever the carrier says."""
    class Carrier:
        def __init__(self):
            self.paused, self.on_resume, self.written = True, None, []

        def write(self, batch: pb.StreamEvents) -> None:
            self.written.append(batch)

    class Context:
        def invocation_metadata(self):
            return (STREAMS_VERSION,)

        async def send_initial_metadata(self, metadata) -> None:
            pass

    async def generate(msg: pb.GenerateRequest, context):
        for i in range(3):
            yield pb.GenerateResponse(request_id=msg.request_id, token_ids=[i])
            await asyncio.sleep(0.01)

    async def go():
        carrier, more = Carrier(), asyncio.Event()

        async def commands():
            for stream, request_id in ((1, "a"), (2, "b")):
                command = pb.StreamCommand(stream=stream)
                command.open.request.request_id = request_id
                yield command
                await more.wait()  # (the second once the first was written)

        serving = asyncio.ensure_future(GenerateStreams(generate).serve(commands(), Context(), carrier))
        await asyncio.sleep(0.3)  # "a" answered everything, and ended, meanwhile
        held = len(carrier.written)
        carrier.paused = False
        carrier.on_resume()
        resumed = list(carrier.written)
        carrier.paused = True  # paused again for the end: the last statuses go anyway
        more.set()
        await asyncio.wait_for(serving, 10)
        return held, resumed, carrier.written[len(resumed):]

    held, resumed, after = asyncio.run(go())
    assert held == 0
    assert len(resumed) == 1  # (merged)
    by_stream = responses_by_stream(resumed)
    assert [list(r.token_ids) for r in by_stream[1]] == [[0], [1], [2]]
    assert [e.status.code for e in resumed[0].events if e.HasField("status")] == [0]
    ended = [e.stream for batch in after for e in batch.events if e.HasField("status")]
    assert ended == [2] and [list(r.token_ids) for r in responses_by_stream(after)[2]] == [[0], [1], [2]]


def test_a_caller_sends_commands_batched_only_to_a_server_that_reads_them(server):
    """To a server that does not say it reads StreamCommand.more (an older one), each command
    goes in a message of its own: none is lost; to one that does, they share messages."""
    class OlderServer(generate_pb2_grpc.GenerateStreamsServicer):
        async def Generate(self, commands, context):
            async for command in commands:  # (it knows nothing of `more`)
                resp = pb.GenerateResponse(request_id=str(command.stream), token_ids=[command.stream])
                yield pb.StreamEvents(events=[pb.StreamEvent(stream=command.stream, response=resp.SerializeToString()),
                                              pb.StreamEvent(stream=command.stream, status=pb.StreamStatus())])

    async def go():
        async with serving(lambda s: generate_pb2_grpc.add_GenerateStreamsServicer_to_server(OlderServer(), s)) as at, \
                streams_at(at) as streams:
            calls = [streams.open(request([1, 2], 1), (), 30) for _ in range(40)]
            got = [await read(call) for call in calls]
            return got, streams.messages_sent

    got, sent = asyncio.run(asyncio.wait_for(go(), 60))
    assert got == [[i + 1] for i in range(40)] and sent == 40

    async def to_this_version():
        async with streams_at(server.address) as streams:
            await read(streams.open(request([1, 2], 1), (), 30))  # (its answer came: so did the server's header)
            before = streams.messages_sent
            calls = [streams.open(request([3, i + 4], 2), (), 30) for i in range(40)]
            got = [await read(call) for call in calls]
            return got, streams.messages_sent - before

    got, sent = asyncio.run(asyncio.wait_for(to_this_version(), 60))
    assert all(len(ids) == 2 for ids in got) and sent < 40


def prefill_streams(channel) -> RequestStreams:
    """A prefill's stream of Prefill requests, as the router opens it (backends.py)."""
    per_call = channel.unary_stream(PREFILL_METHOD, request_serializer=pb.GenerateRequest.SerializeToString,
                                    response_deserializer=None)
    return RequestStreams(channel, per_call, PREFILL_STREAMS_METHOD)


async def prefill_replies(call) -> list[internal_pb2.PrefillResponse]:
    return [internal_pb2.PrefillResponse.FromString(raw) async for raw in call]


@pytest.mark.parametrize("transport", ["grpc", "frames"])
def test_prefill_calls_on_one_stream_answer_as_their_own_calls(tiny_llama, transport):
    """On a prefill's Streams, each request answers what its own Prefill call would: one reply,
    its first token and the handle of its held blocks (which Release lets go); a bad request
    fails alone, naming the field, and one without the stack's token is refused. Over gRPC and
    over frames alike."""
    prefill = ServerProcess(tiny_llama, "--role", "prefill", "--internal-token", TOKEN)
    prompts = random_prompts([19, 44, 7, 31, 26, 12], seed=204)
    want = greedy(tiny_llama, prompts, 1)
    token = token_metadata(TOKEN)

    async def go():
        frames = internal_pb2.FRAMES_SERVICE_PREFILL if transport == "frames" else 0
        async with streams_at(prefill.address, prefill_streams, frames) as streams:
            calls = [streams.open(request(p, 8, request_id=f"p{i}"), token, 30) for i, p in enumerate(prompts)]
            bad = streams.open(request(prompts[0], 8, top_p=2.0), token, 30)
            outsider = streams.open(request(prompts[1], 8), (), 30)
            replies = [await prefill_replies(call) for call in calls]
            errors = []
            for call in (bad, outsider):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await prefill_replies(call)
                errors.append(err.value)
            held = stats(prefill.address).num_held
            assert (streams.frames is not None) == (transport == "frames")
            async with grpc.aio.insecure_channel(prefill.address) as channel:
                stub = internal_pb2_grpc.PrefillStub(channel)
                released = [(await stub.Release(r.handle, metadata=token)).released for [r] in replies]
            return replies, errors, held, released, streams.supported

    try:
        replies, (bad, outsider), held, released, supported = asyncio.run(asyncio.wait_for(go(), 120))
        assert supported and [len(r) for r in replies] == [1] * len(prompts)
        assert [list(r.first.token_ids) for [r] in replies] == want
        assert [r.handle.request_id for [r] in replies] == [f"p{i}" for i in range(len(prompts))]
        assert held == len(prompts) and released == [True] * len(prompts)
        assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and failure_of_error(bad).field == "sampling.top_p"
        assert outsider.code() == grpc.StatusCode.PERMISSION_DENIED
        assert pools_full(prefill.address) and stats(prefill.address).num_held == 0
    finally:
        prefill.stop()


def test_a_prefill_without_streams_gets_a_prefill_call_each():
    """A prefill that has no Streams (an older one: UNIMPLEMENTED) answers each request on a
    Prefill call of its own, read as its stream would have been."""
    class OlderPrefill(internal_pb2_grpc.PrefillServicer):
        async def Prefill(self, msg, context):
            return internal_pb2.PrefillResponse(first=pb.GenerateResponse(request_id=msg.request_id, token_ids=[7]))

    async def go():
        async with serving(lambda s: internal_pb2_grpc.add_PrefillServicer_to_server(OlderPrefill(), s)) as at, \
                streams_at(at, prefill_streams) as streams:
            first = [await prefill_replies(streams.open(pb.GenerateRequest(request_id="a"), (), 30))]
            rest = await asyncio.gather(*(prefill_replies(streams.open(pb.GenerateRequest(request_id=str(i)), (), 30))
                                          for i in range(5)))
            return first + rest, streams.supported

    replies, supported = asyncio.run(asyncio.wait_for(go(), 60))
    assert not supported
    assert [[(r.first.request_id, list(r.first.token_ids)) for r in each] for each in replies] == [
        [(name, [7])] for name in ("a", *map(str, range(5)))]


def test_a_request_s_context_tells_its_callbacks_how_it_ended():
    """As a call's context does (a prefill lets go of the blocks of a request whose caller went
    away by it): once a request of a stream ended, its callbacks see cancelled() true where the
    caller cancelled it or its deadline passed, false where it answered."""
    ended: dict[str, bool] = {}
    started: set[str] = set()

    async def generate(msg: pb.GenerateRequest, context):
        def on_end(ctx) -> None:
            ended[msg.request_id] = ctx.cancelled()
        context.add_done_callback(on_end)
        started.add(msg.request_id)
        if msg.request_id != "answers":
            await asyncio.Event().wait()  # until the caller cancels it or its deadline passes
        yield pb.GenerateResponse(request_id=msg.request_id, token_ids=[5])

    async def go():
        async with serving(lambda s: generate_pb2_grpc.add_GenerateStreamsServicer_to_server(
                GenerateStreams(generate), s)) as at, streams_at(at) as streams:
            answered = await read(streams.open(pb.GenerateRequest(request_id="answers"), (), 30))
            cancelled = streams.open(pb.GenerateRequest(request_id="cancelled"), (), 30)
            late = streams.open(pb.GenerateRequest(request_id="late"), (), 0.3)
            while "cancelled" not in started:
                await asyncio.sleep(0.01)
            cancelled.cancel()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await read(late)
            while len(ended) < 3:
                await asyncio.sleep(0.01)
            return answered, err.value.code()

    answered, late = asyncio.run(asyncio.wait_for(go(), 30))
    assert answered == [5] and late == grpc.StatusCode.DEADLINE_EXCEEDED
    assert ended == {"answers": False, "cancelled": True, "late": True}


def test_frames_are_cut_from_bytes_however_they_arrive():
    buffer = FrameBuffer(max_frame_bytes=64)
    wire = frame(b"first") + frame(b"") + frame(b"x" * 64)
    got = [f for i in range(len(wire)) for f in buffer.feed(wire[i:i + 1])]  # a byte at a time
    assert got == [b"first", b"", b"x" * 64]
    assert buffer.feed(frame(b"a") + frame(b"bc") + frame(b"def")[:3]) == [b"a", b"bc"]
    with pytest.raises(FrameError, match="65 bytes, more than the 64"):
        FrameBuffer(max_frame_bytes=64).feed(frame(b"y" * 65))


async def answer_five(msg: pb.GenerateRequest, context):
    yield pb.GenerateResponse(request_id=msg.request_id, token_ids=[5])


@contextlib.asynccontextmanager
async def frames_listener(services: dict):
    """An in-process frames listener on 127.0.0.1: its port."""
    listener = FramesServer(services, 1 << 20)
    try:
        yield await listener.start("127.0.0.1", 0)
    finally:
        listener.close()


@contextlib.asynccontextmanager
async def silent_listener():
    """A port that takes connections and never answers (a proxy holding them, say): its port."""
    held = []
    server = await asyncio.start_server(lambda reader, writer: held.append(writer), "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for writer in held:
            writer.close()


@pytest.mark.parametrize("port_is", ["closed", "silent"])
def test_a_frames_stream_that_cannot_connect_goes_over_grpc_and_its_requests_are_answered(port_is):
    """A frames port that does not answer (gone, or firewalled, or held by something that never
    answers) costs no request: those opened on it go as calls of their own, and the next stream
    goes over gRPC."""
    async def go():
        async with serving(lambda s: generate_pb2_grpc.add_GenerateStreamsServicer_to_server(
                GenerateStreams(answer_five), s)) as at, streams_at(at) as streams, silent_listener() as silent:
            if port_is == "closed":  # (the listener's own port, closed again: nothing listens there)
                async with frames_listener({}) as port:
                    pass
            else:
                port = silent
            streams.frames = FramesOpener("127.0.0.1", port, internal_pb2.FRAMES_SERVICE_GENERATE, hello_timeout_s=0.5)
            started = time.monotonic()
            first = await asyncio.gather(*(read(streams.open(pb.GenerateRequest(request_id=str(i)), (), 30))
                                           for i in range(3)))
            waited = time.monotonic() - started
            then = await read(streams.open(pb.GenerateRequest(request_id="then"), (), 30))
            return first, then, streams.frames, streams.supported, waited

    first, then, frames, supported, waited = asyncio.run(asyncio.wait_for(go(), 60))
    assert first == [[5]] * 3 and then == [5]
    assert frames is None and supported
    assert waited >= 0.5 if port_is == "silent" else waited < 0.5  # (the hello's timeout, only where it counts)


def test_a_frames_listener_refuses_what_it_does_not_serve_and_drops_a_caller_that_is_not_one():
    """A stream the server does not serve is refused with UNIMPLEMENTED, naming it; a caller that
    sends what is not a frame is cut off; neither touches a caller streaming beside them, whose
    requests end when its connection does."""
    ended: dict[str, bool] = {}

    async def generate(msg: pb.GenerateRequest, context):
        context.add_done_callback(lambda ctx: ended.__setitem__(msg.request_id, ctx.cancelled()))
        yield pb.GenerateResponse(request_id=msg.request_id, token_ids=[5])
        if msg.request_id == "waits":
            await asyncio.Event().wait()  # until its caller goes

    async def commands(*opened: str):
        for i, request_id in enumerate(opened):
            command = pb.StreamCommand(stream=i + 1)
            command.open.request.request_id = request_id
            yield command
        await asyncio.Event().wait()

    async def go():
        async with frames_listener({internal_pb2.FRAMES_SERVICE_GENERATE: GenerateStreams(generate)}) as port:
            streaming = FramesOpener("127.0.0.1", port, internal_pb2.FRAMES_SERVICE_GENERATE)(
                commands("answers", "waits"), (STREAMS_VERSION,))
            headers = await streaming.initial_metadata()
            refused = FramesOpener("127.0.0.1", port, internal_pb2.FRAMES_SERVICE_PREFILL)(commands(), ())
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await refused.initial_metadata()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write((1 << 31).to_bytes(4, "big"))  # a frame longer than any the listener takes
            cut_off = await asyncio.wait_for(reader.read(), 10) == b""
            writer.close()
            responses, events = 0, aiter(streaming)
            while responses < 2:  # (each request's response; "answers" ends, "waits" waits)
                batch = await anext(events)
                responses += sum(e.HasField("response") for e in batch.events) + len(batch.tokens.streams)
            streaming.cancel()
            while len(ended) < 2:
                await asyncio.sleep(0.01)
            return headers, err.value, cut_off

    headers, refused, cut_off = asyncio.run(asyncio.wait_for(go(), 60))
    assert STREAMS_VERSION in headers
    assert refused.code() == grpc.StatusCode.UNIMPLEMENTED and "FRAMES_SERVICE_PREFILL" in refused.details()
    assert cut_off
    assert ended == {"answers": False, "waits": True}
