"""Images through `baton serve` (a LLaVA of random weights, test_vision_language.py's): gRPC chat
messages carry images (bytes or URLs) and the OpenAI front takes image_url content parts; data:
URLs, file:// under --allowed-local-media-path and http(s) from a server on loopback give the
offline engine's output for the same pictures. Bad images are INVALID_ARGUMENT / 400 naming the
image's field: bytes that are no image, a file outside the allowed path, a host not allowed, a
file over the byte limit, more images than --limit-mm-per-prompt, images sent to a text model;
the server carries on, its pool full. The router hashes an image chat's blocks up to its first
image as the engines do."""
from __future__ import annotations

import base64
import http.server
import io
import threading

import grpc
import numpy as np
import openai
import pytest
from PIL import Image

from baton import LLM, SamplingParams
from baton.services.server.media import MediaOptions
from baton.testing.checkpoints import write_random_llava, write_random_qwen2_5_vl
from baton.v1 import generate_pb2 as pb
from baton.v1 import generate_pb2_grpc as pb_grpc

TEXT = "What is in this picture?"


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> str:
    return write_random_llava(str(tmp_path_factory.mktemp("llava") / "llava"), seed=3)


def png(seed: int, size=(37, 45)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def offline(model_dir: str, picture: bytes, n: int) -> list[int]:
    """The offline engine's greedy tokens for TEXT after the picture, through the chat template."""
    llm = LLM(model_dir, dtype="float32", device="cpu")
    image_text = llm.engine.inputs.images.image_text  # ("<image>\n"; Qwen2.5-VL's vision start, pad, end)
    ids = llm.engine.inputs.apply_chat_template([{"role": "user", "content": image_text + TEXT}])
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": Image.open(io.BytesIO(picture))}},
                       SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return out[0].token_ids


def generate(address: str, *images: pb.Image, n: int = 8) -> list[int]:
    request = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=TEXT, images=images)]),
                                 sampling=pb.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    with grpc.insecure_channel(address) as channel:
        return [t for r in pb_grpc.TextGenerationStub(channel).Generate(request, timeout=60) for t in r.token_ids]


class _Pictures(http.server.BaseHTTPRequestHandler):
    files: dict[str, bytes] = {}
    hits: list[str] = []  # the paths asked for, in order

    def do_GET(self):
        self.hits.append(self.path)
        body = self.files.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args):
        pass


@pytest.fixture
def pictures_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Pictures)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def test_images_through_grpc_and_the_openai_front(serve, llava, tmp_path, pictures_server):
    picture, big = png(1), png(2, (400, 400))
    (tmp_path / "cat.png").write_bytes(picture)
    _Pictures.files = {"/cat.png": picture, "/big.png": big}
    want = offline(llava, picture, 8)
    srv = serve(llava, {"http_port": 0, "media": MediaOptions(
        allowed_local_media_path=str(tmp_path), allowed_media_domains=["127.0.0.1"], limit_images=2,
        max_image_bytes=len(big) - 1)})
    host, port = pictures_server.server_address
    data_url = "data:image/png;base64," + base64.b64encode(picture).decode()
    for image in (pb.Image(data=picture), pb.Image(url=data_url), pb.Image(url=f"file://{tmp_path}/cat.png"),
                  pb.Image(url=f"http://{host}:{port}/cat.png")):
        assert generate(srv.address, image) == want, image.WhichOneof("source")
    client = openai.OpenAI(base_url=srv.server.http.url + "/v1", api_key="none", max_retries=0)
    chat = client.chat.completions.create(
        model=srv.server.model_name, max_tokens=8, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "text", "text": TEXT},
                                               {"type": "image_url", "image_url": {"url": data_url}}]}])
    assert chat.choices[0].message.content == srv.server.core.tokenizer.decode(want, skip_special_tokens=True)
    assert chat.usage.prompt_tokens > 25  # the image's span counted
    outside = tmp_path.parent / "outside.png"
    outside.write_bytes(picture)
    for images, field in (
            ([pb.Image(data=b"not an image")], "chat.messages[0].images[0]"),
            ([pb.Image(data=picture), pb.Image(url=f"file://{outside}")], "chat.messages[0].images[1]"),
            ([pb.Image(url=f"http://localhost:{port}/cat.png")], "chat.messages[0].images[0]"),
            ([pb.Image(url=f"http://{host}:{port}/big.png")], "chat.messages[0].images[0]"),
            ([pb.Image(url=f"http://{host}:{port}/missing.png")], "chat.messages[0].images[0]"),
            ([pb.Image(url="ftp://example.com/a.png")], "chat.messages[0].images[0]"),
            ([pb.Image(data=picture)] * 3, "chat.messages.images")):
        with pytest.raises(grpc.RpcError) as err:
            generate(srv.address, *images)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith(field), \
            (field, err.value.details())
    not_png = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    for parts, param in (([{"type": "text", "text": TEXT}, not_png], "messages[0].content[1]"),
                         ([{"type": "image_url", "image_url": {"url": data_url}}] * 3, "messages")):
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model=srv.server.model_name, max_tokens=2,
                                           messages=[{"role": "user", "content": parts}])
        assert bad.value.body["param"] == param and bad.value.body["message"].startswith(param), bad.value.body
    assert generate(srv.address, pb.Image(data=picture)) == want  # nothing disturbed
    assert srv.wait_pool_full()


def test_images_to_a_text_model_are_refused(serve, tiny_llama):
    srv = serve(tiny_llama)
    with pytest.raises(grpc.RpcError) as err:
        generate(srv.address, pb.Image(data=png(3)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "chat.messages.images" in err.value.details()


def test_an_image_request_through_the_router_to_prefill_and_decode(llava):
    """The router passes a chat's images to both tiers: the prefill encodes them and computes the
    prompt, the decode READs its blocks (taking the images' spans from the prefill's handle); the
    stream equals the offline engine's."""
    from helpers import pools_full, stats, wait_serving
    from servers import pd_stack

    picture = png(5)
    want = offline(llava, picture, 8)
    with pd_stack(llava) as (prefills, decodes, router):
        wait_serving(router.address, timeout=60)
        assert generate(router.address, pb.Image(data=picture)) == want
        assert generate(router.address, pb.Image(url="data:image/png;base64," + base64.b64encode(picture).decode())) \
            == want
        decode = decodes[0].address
        assert stats(decode).num_blocks_pulled > 0  # its prompt's KV came over the wire, images and all
        assert pools_full(decode) and pools_full(prefills[0].address)


def test_a_qwen_vl_image_through_the_router_reaches_the_decode_as_its_span(serve, tmp_path, pictures_server):
    """Qwen2.5-VL served: an image URL through the router to a prefill and a decode equals the
    offline engine's, and only the prefill fetches it (the decode takes the image's span from the
    prefill's KV handle: its positions need the grid, not the pixels). Where the decode must
    compute over the image after all (the prefill's hold too short to read within), it says so
    and the router sends the request again without the handle: the decode fetches the image then,
    and the stream is the same. The OpenAI front gives the same tokens."""
    from helpers import pools_full, stats, wait_serving
    from servers import pd_stack

    model_dir = write_random_qwen2_5_vl(str(tmp_path / "qwen-vl"), seed=6)
    picture = png(6, (41, 57))
    host, port = pictures_server.server_address
    _Pictures.files, _Pictures.hits = {"/cat.png": picture}, []
    url = pb.Image(url=f"http://{host}:{port}/cat.png")
    want = offline(model_dir, picture, 8)
    media = ("--allowed-media-domains", "127.0.0.1")
    for prefill_flags, fetches, pulled in (((), 1, True), (("--kv-hold-timeout", "10"), 2, False)):
        _Pictures.hits.clear()
        with pd_stack(model_dir, common=media, prefill=prefill_flags) as (prefills, decodes, router):
            wait_serving(router.address, timeout=60)
            assert generate(router.address, url) == want, prefill_flags
            assert len(_Pictures.hits) == fetches, prefill_flags
            assert (stats(decodes[0].address).num_blocks_pulled > 0) == pulled
            assert pools_full(decodes[0].address) and pools_full(prefills[0].address)
    srv = serve(model_dir, {"http_port": 0})
    client = openai.OpenAI(base_url=srv.server.http.url + "/v1", api_key="none", max_retries=0)
    data_url = "data:image/png;base64," + base64.b64encode(picture).decode()
    chat = client.chat.completions.create(
        model=srv.server.model_name, max_tokens=8, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url}},
                                               {"type": "text", "text": TEXT}]}])
    assert chat.choices[0].message.content == srv.server.core.tokenizer.decode(want, skip_special_tokens=True)
    assert srv.wait_pool_full()


@pytest.mark.parametrize("family", ["llava", "qwen", "gemma"])
def test_the_router_hashes_an_image_chat_up_to_its_image_as_the_engines_do(family, tmp_path):
    """The blocks before a chat's first image hash as an engine's do (kv_aware and prefix_affinity
    find them); the router hashes nothing past it, where the engines' hashes depend on the image."""
    from baton.engine.common.block_hashes import ROOT_HASH, extend_block_hashes
    from baton.engine.common.tokenizer import load_tokenizer
    from baton.services.router.prompt_hashes import PromptHasher
    from baton.services.rpc.chat import chat_messages
    from baton.testing.checkpoints import write_random_gemma3_vl

    writer = {"llava": write_random_llava, "qwen": write_random_qwen2_5_vl, "gemma": write_random_gemma3_vl}[family]
    model = writer(str(tmp_path / family), seed=1)
    block = 16
    hasher = PromptHasher(model, block, None)
    hasher.tokenizer = load_tokenizer(model)
    inputs = LLM(model, dtype="float32", device="cpu").engine.inputs
    system = "You describe pictures in plain words, briefly and without guessing at what is not shown. " * 2

    def chat(picture: bytes) -> pb.GenerateRequest:
        return pb.GenerateRequest(chat=pb.Chat(messages=[
            pb.ChatMessage(role="system", content=system),
            pb.ChatMessage(role="user", content=TEXT, images=[pb.Image(data=picture)])]))

    def engine_hashes(picture: bytes) -> list[int]:
        ids = inputs.apply_chat_template(chat_messages(chat(picture).chat, inputs.images.image_text))
        return extend_block_hashes([], inputs.images.expand(ids, [picture], "images")[0], block)

    routed = hasher.hashes(chat(png(1)), ROOT_HASH)
    one, other = engine_hashes(png(1)), engine_hashes(png(2, size=(40, 33)))
    assert len(routed) >= 2 and routed == one[:len(routed)]
    assert hasher.hashes(chat(png(2, size=(40, 33))), ROOT_HASH) == routed
    assert one[:len(routed)] == other[:len(routed)] and one[len(routed) + 1:] != other[len(routed) + 1:]
    text_only = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=system)]))
    assert hasher.hashes(text_only, ROOT_HASH) == extend_block_hashes(
        [], inputs.apply_chat_template([{"role": "user", "content": system}]), block)


def test_an_encoder_tier_encodes_the_images_and_the_prefill_reads_their_embeddings(tmp_path, pictures_server,
                                                                                   trace_receiver, monkeypatch):
    """E/P/D with Qwen2.5-VL (M-RoPE): the router sends an image chat through the encoder, which
    fetches and encodes the image; the prefill READs its embeddings over NIXL (it may fetch from
    no host here), the decode gets the span. The stream equals the offline engine's, and one trace
    holds the encoder's phase and the decode's transfer. A second chat with the same image is not
    encoded again. A picture that does not decode is INVALID_ARGUMENT naming its field, from the
    encoder. With the encoder gone the prefill encodes the image."""
    from helpers import pools_full, stats, wait_serving
    from servers import epd_stack

    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # (the children's spans arrive within ms)

    model_dir = write_random_qwen2_5_vl(str(tmp_path / "qwen-vl"), seed=7)
    picture = png(7, (43, 39))
    host, port = pictures_server.server_address
    _Pictures.files, _Pictures.hits = {"/dog.png": picture}, []
    url = pb.Image(url=f"http://{host}:{port}/dog.png")
    want = offline(model_dir, picture, 8)
    nowhere = ("--allowed-media-domains", "example.invalid")
    with epd_stack(model_dir, encoder=("--allowed-media-domains", "127.0.0.1"), prefill=nowhere,
                   decode=nowhere, common=("--otlp-traces-endpoint", trace_receiver.endpoint)
                   ) as (encoders, prefills, decodes, router):
        wait_serving(router.address, timeout=60)
        assert generate(router.address, url) == want
        assert _Pictures.hits == ["/dog.png"]  # the encoder's

        def traced(spans) -> bool:  # the encoder's phase and the decode's READ in one trace
            encoded = {s.trace_id for s in spans if s.name == "encode" and s.role == "encoder"}
            return any(s.trace_id in encoded for s in spans if s.name == "kv_transfer" and s.role == "decode")
        assert trace_receiver.wait_for(traced)
        assert generate(router.address, pb.Image(data=picture)) == want
        logged = [line for line in encoders[0].lines if "images," in line]
        assert [" 1 encoded, 0 held already" in logged[0], " 0 encoded, 1 held already" in logged[1]] == [True, True]
        with pytest.raises(grpc.RpcError) as bad:
            generate(router.address, pb.Image(data=b"not a picture"))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "chat.messages[0].images[0]" in bad.value.details()
        assert not any("could not be read" in line for line in prefills[0].lines)
        assert stats(decodes[0].address).num_blocks_pulled > 0
        encoders[0].stop()
        assert generate(router.address, pb.Image(data=picture)) == want  # the prefill encodes it
        with pytest.raises(grpc.RpcError) as far:
            generate(router.address, url)  # (which the prefill may not fetch)
        assert far.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "allowed-media-domains" in far.value.details()
        assert pools_full(decodes[0].address) and pools_full(prefills[0].address)


def test_baton_up_with_an_encoder_tier_serves_images_through_it(llava):
    """`baton up --encode 1`: an encoder beside the prefill and the decode, the router sending image
    chats through it (its metrics count the call); the stream equals the offline engine's."""
    import urllib.request

    from servers import Up

    from baton.services.rpc.serving import free_port

    picture = png(9)
    want = offline(llava, picture, 8)
    port, http_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    up = Up("--model", llava, "--port", str(port), "--http-port", str(http_port), "--dtype", "float32",
            "--encode", "1")
    try:
        assert "1 encoder + 1 prefill + 1 decode" in up.wait_for("Baton is up").string
        assert sorted(up.children()) == ["decode", "encoder", "prefill", "router"]
        assert generate(f"127.0.0.1:{port}", pb.Image(data=picture)) == want
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10).read().decode()
        calls = [line for line in metrics.splitlines()
                 if line.startswith("baton:router_backend_requests_total") and 'tier="encoder"' in line]
        assert len(calls) == 1 and calls[0].endswith(" 1.0"), calls
    finally:
        assert up.stop() == 0


def test_a_stream_moving_to_another_decode_is_prefilled_again_and_no_decode_reads_its_image(tmp_path,
                                                                                           pictures_server):
    """kill -9 of a decode mid-stream in P/D with Qwen2.5-VL: the router has a prefill compute the
    prompt again and the next decode pulls its blocks and recomputes only the tokens streamed so
    far, so it needs no image either (the decodes may fetch from no host here: one that read the
    image would fail). Every stream ends as an uninterrupted run; the prefill fetched the image once
    per request and once per move."""
    import asyncio
    import contextlib

    from helpers import TOKEN, pools_full, stats, wait_serving
    from servers import ServerProcess

    from baton.v1 import generate_pb2_grpc as pb_grpc

    model_dir = write_random_qwen2_5_vl(str(tmp_path / "qwen-vl"), seed=6)
    picture = png(8, (41, 37))
    host, port = pictures_server.server_address
    _Pictures.files, _Pictures.hits = {"/owl.png": picture}, []
    want = offline(model_dir, picture, 500)
    request = pb.GenerateRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=TEXT,
                                              images=[pb.Image(url=f"http://{host}:{port}/owl.png")])]),
        sampling=pb.SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True))
    with contextlib.ExitStack() as stack:
        def start(*flags: str) -> ServerProcess:
            proc = ServerProcess(model_dir, "--internal-token", TOKEN, *flags)
            stack.callback(proc.stop)
            return proc
        prefill = start("--role", "prefill", "--allowed-media-domains", "127.0.0.1")
        decodes = [start("--role", "decode", "--allowed-media-domains", "example.invalid") for _ in range(2)]
        router = start("--role", "router", "--prefill", prefill.address, "--decode",
                       ",".join(d.address for d in decodes))
        wait_serving(router.address, timeout=60)

        async def stream(started: asyncio.Event) -> list[int]:
            ids = []
            async with grpc.aio.insecure_channel(router.address) as channel:
                async for resp in pb_grpc.TextGenerationStub(channel).Generate(request, timeout=120):
                    ids += resp.token_ids
                    if len(ids) >= 3:
                        started.set()
            return ids

        async def go() -> list[list[int]]:
            events = [asyncio.Event() for _ in range(4)]
            tasks = [asyncio.ensure_future(stream(e)) for e in events]
            await asyncio.gather(*(e.wait() for e in events))
            decodes[0].kill()
            return await asyncio.gather(*tasks)

        assert asyncio.run(asyncio.wait_for(go(), 180)) == [want] * 4
        moved = stats(decodes[1].address).num_requests - 2  # (round robin: two each at first)
        assert moved == 2 and len(_Pictures.hits) == 4 + moved
        assert pools_full(prefill.address) and pools_full(decodes[1].address)
