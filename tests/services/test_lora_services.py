"""LoRA adapters served: over gRPC and the OpenAI HTTP front of a colocated server (loaded at
start and at run time, listed, unloaded, refused with the right status naming the field),
and split across prefill and decode behind the router, equal to transformers + PEFT."""
from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import grpc
import pytest
from helpers import AUTH, collect, pools_full, random_prompts, wait_serving
from servers import pd_stack

from baton.services.client import AsyncClient
from baton.services.rpc.errors import failure_of_error
from baton.v1 import generate_pb2 as pb
from baton.v1 import generate_pb2_grpc

MAX_TOKENS = 10


def want(peft_ref, adapters, prompt, name) -> list[int]:
    return peft_ref.greedy(adapters[name] if name else None, prompt, MAX_TOKENS)


async def mixed_run(address: str, prompts, names) -> list[list[int]]:
    async with AsyncClient(address) as client:
        outs = await asyncio.gather(*(collect(client, p, adapter=n or "", max_tokens=MAX_TOKENS, temperature=0.0,
                                              ignore_eos=True) for p, n in zip(prompts, names)))
    return [ids for ids, _, _ in outs]


def http(url: str, body: dict | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_colocated_server_grpc_and_http(serve, tiny_llama, adapters, peft_ref):
    server = serve(tiny_llama, {"http_port": 0}, lora_modules={"sql": adapters["sql"], "chat": adapters["chat"]},
                   max_loras=2, max_cpu_loras=3)
    prompts = random_prompts([9, 30, 47, 21, 64, 12], seed=21)
    names = ["sql", "chat", None, "chat", "sql", None]
    assert asyncio.run(mixed_run(server.address, prompts, names)) == [
        want(peft_ref, adapters, p, n) for p, n in zip(prompts, names)]

    async def runtime():
        async with grpc.aio.insecure_channel(server.address) as channel:
            api = generate_pb2_grpc.TextGenerationStub(channel)
            listed = await api.ListAdapters(pb.ListAdaptersRequest())
            assert sorted(a.name for a in listed.adapters) == ["chat", "sql"]
            with pytest.raises(grpc.aio.AioRpcError) as e:  # not loaded: NOT_FOUND naming the field
                async for _ in api.Generate(pb.GenerateRequest(text="hi", adapter="code")):
                    pass
            assert e.value.code() == grpc.StatusCode.NOT_FOUND and failure_of_error(e.value).field == "adapter"
            loaded = await api.LoadAdapter(pb.LoadAdapterRequest(lora_name="code", lora_path=adapters["code"]))
            assert loaded.rank == 16 and loaded.hash_root != 0
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await api.LoadAdapter(pb.LoadAdapterRequest(lora_name="bad", lora_path="/nonexistent"))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and failure_of_error(e.value).field == "lora_path"
            # Unloading an adapter while a request uses it is refused; the request is untouched.
            call = api.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompts[0]), adapter="sql",
                                                   sampling=pb.SamplingParams(max_tokens=200, ignore_eos=True,
                                                                              temperature=0.0)))
            first = await call.read()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await api.UnloadAdapter(pb.UnloadAdapterRequest(lora_name="sql"))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            tokens = list(first.token_ids)
            while (resp := await call.read()) is not grpc.aio.EOF:
                tokens += resp.token_ids
            assert tokens[:MAX_TOKENS] == want(peft_ref, adapters, prompts[0], "sql") and len(tokens) == 200
            await api.UnloadAdapter(pb.UnloadAdapterRequest(lora_name="sql"))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await api.UnloadAdapter(pb.UnloadAdapterRequest(lora_name="sql"))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND and failure_of_error(e.value).field == "lora_name"
    asyncio.run(runtime())
    # The adapter loaded at run time serves; three adapters took turns in two device slots.
    assert asyncio.run(mixed_run(server.address, prompts[:3], ["code", "chat", None])) == [
        want(peft_ref, adapters, p, n) for p, n in zip(prompts[:3], ["code", "chat", None])]

    url = server.server.http.url
    status, body = http(f"{url}/v1/models")
    models = {m["id"]: m for m in json.loads(body)["data"]}
    base = next(m for m in models.values() if m["parent"] is None)["id"]
    assert set(models) == {base, "chat", "code"} and models["code"]["parent"] == base
    assert http(f"{url}/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": adapters["sql"]})[0] == 200
    status, body = http(f"{url}/v1/completions", {"model": "sql", "prompt": prompts[1], "max_tokens": MAX_TOKENS,
                                                  "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    assert json.loads(body)["model"] == "sql"
    status, body = http(f"{url}/v1/completions", {"model": "nope", "prompt": "hi", "max_tokens": 2})
    assert status == 404 and "nope" in json.loads(body)["error"]["message"]
    status, body = http(f"{url}/v1/load_lora_adapter", {"lora_name": "x"})
    assert status == 400 and json.loads(body)["error"]["param"] == "lora_path"
    assert http(f"{url}/v1/unload_lora_adapter", {"lora_name": "sql"})[0] == 200
    assert http(f"{url}/v1/unload_lora_adapter", {"lora_name": "sql"})[0] == 404
    assert server.wait_pool_full()


def test_split_across_prefill_and_decode_behind_the_router(tiny_llama, adapters, peft_ref):
    modules = ("--lora-modules", f"sql={adapters['sql']}", f"chat={adapters['chat']}", "--max-loras", "2")
    with pd_stack(tiny_llama, prefill=modules, decode=modules) as (prefills, decodes, router):
        wait_serving(router.address)
        prompts = random_prompts([12, 40, 70, 25], seed=22)
        names = ["sql", None, "chat", "sql"]
        assert asyncio.run(mixed_run(router.address, prompts, names)) == [
            want(peft_ref, adapters, p, n) for p, n in zip(prompts, names)]

        async def runtime():
            async with grpc.aio.insecure_channel(router.address) as channel:
                api = generate_pb2_grpc.TextGenerationStub(channel)
                # Loaded through the router: on every instance.
                loaded = await api.LoadAdapter(pb.LoadAdapterRequest(lora_name="code", lora_path=adapters["code"]))
                assert sorted(loaded.instances) == sorted(p.address for p in prefills + decodes)
                listed = {a.name: a for a in (await api.ListAdapters(pb.ListAdaptersRequest())).adapters}
                assert set(listed) == {"sql", "chat", "code"} and len(listed["code"].instances) == 2
                # Loaded on the prefill only: no decode has it, and the router says so.
                async with grpc.aio.insecure_channel(prefills[0].address) as pch:
                    await generate_pb2_grpc.TextGenerationStub(pch).LoadAdapter(
                        pb.LoadAdapterRequest(lora_name="only-prefill", lora_path=adapters["code"]), metadata=AUTH)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in api.Generate(pb.GenerateRequest(text="hi", adapter="only-prefill")):
                        pass
                assert e.value.code() == grpc.StatusCode.NOT_FOUND and failure_of_error(e.value).field == "adapter"
        asyncio.run(runtime())
        assert asyncio.run(mixed_run(router.address, prompts[:2], ["code", "chat"])) == [
            want(peft_ref, adapters, p, n) for p, n in zip(prompts[:2], ["code", "chat"])]
        assert all(pools_full(p.address) for p in prefills + decodes)
