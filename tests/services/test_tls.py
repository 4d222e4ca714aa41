"""TLS between the tiers and for clients, with certificates made here: a stack of prefill,
decode and router processes under mTLS streams to a client with a valid certificate and
refuses the others; the KV handshake and the router's calls go over TLS too (check-stack
proves the blocks moved); the HTTP front speaks HTTPS with the same files."""
from __future__ import annotations

import asyncio
import datetime
import ssl
import subprocess
import sys
import urllib.request

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from helpers import TOKEN, wait_serving

from baton import LLM, SamplingParams
from baton.services.client import AsyncClient, Client
from baton.services.rpc.frames import FramesOpener
from baton.services.rpc.tls import TLSConfig, aio_channel
from baton.v1 import generate_pb2 as pb
from baton.v1 import generate_pb2_grpc, internal_pb2

SERVER_NAME = "baton.internal"  # the only name in the servers' certificate: calls by IP need the override


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key, issuer: str, issuer_key, *, ca: bool = False, dns: tuple[str, ...] = ()):
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if dns:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(d) for d in dns]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path, cert, key=None) -> str:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM) if key is None else
                     key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return str(path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, the servers' certificate (also their client certificate on internal calls), a
    client's, and a client certificate from another CA."""
    d = tmp_path_factory.mktemp("pki")
    files = {}
    ca_key, other_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _cert("baton-ca", ca_key, "baton-ca", ca_key, ca=True)
    other_ca = _cert("other-ca", other_key, "other-ca", other_key, ca=True)
    files["ca"] = _write(d / "ca.crt", ca)
    for name, issuer, issuer_key, dns in (("server", "baton-ca", ca_key, (SERVER_NAME,)),
                                          ("client", "baton-ca", ca_key, ()),
                                          ("stranger", "other-ca", other_key, ())):
        key = ec.generate_private_key(ec.SECP256R1())
        files[name] = _write(d / f"{name}.crt", _cert(name, key, issuer, issuer_key, dns=dns))
        files[name + "_key"] = _write(d / f"{name}.key", None, key)
    assert other_ca is not None
    return files


def tls_flags(pki) -> list[str]:
    return ["--tls-cert-file", pki["server"], "--tls-key-file", pki["server_key"], "--tls-ca-file", pki["ca"],
            "--tls-server-name", SERVER_NAME]


def client_tls(pki, who: str = "client", **overrides) -> TLSConfig:
    kwargs = dict(cert_file=pki[who], key_file=pki[who + "_key"], ca_file=pki["ca"], server_name=SERVER_NAME)
    return TLSConfig(**{**kwargs, **overrides})


def metrics_address(proc) -> str:
    proc.address  # noqa: B018 - the metrics line comes before "serving on"
    line = next(ln for ln in proc.lines if ln.startswith("metrics on "))
    return line.split()[2].removeprefix("http://").split("/")[0]


@pytest.fixture(scope="module")
def stack(tiny_llama, pki):
    from servers import ServerProcess, pd_stack

    metrics = ("--metrics-port", "0")
    with pd_stack(tiny_llama, prefill=metrics, decode=metrics, router=("--http-port", "0"),
                  common=tuple(tls_flags(pki))) as ((prefill,), (decode,), router):
        # Decodes only: the prefill is up, but nobody sends it prompts.
        decode_only = ServerProcess(tiny_llama, "--role", "router", "--decode", decode.address,
                                    "--internal-token", TOKEN, *tls_flags(pki))
        try:
            for p in (router, decode_only):
                wait_serving(p.address, 60, client_tls(pki))
            yield prefill, decode, router, decode_only
        finally:
            decode_only.stop()


def _generate(address: str, tls: TLSConfig | None, prompt: list[int]) -> list[int]:
    with Client(address, tls=tls) as client:
        return [t for chunk in client.generate(prompt, max_tokens=12, temperature=0.0, timeout=30)
                for t in chunk.token_ids]


def test_a_client_with_a_valid_certificate_streams_what_the_engine_computes(stack, pki, tiny_llama):
    router = stack[2]
    prompt = list(range(5, 70))  # several blocks: the decode pulls them from the prefill, over TLS
    want = LLM(tiny_llama, dtype="float32", device="cpu").generate(
        [prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids
    got = _generate(router.address, client_tls(pki), prompt)
    assert got[:len(want)] == want and len(got) == 12
    # The router's streams of requests to both tiers went over frames, under TLS as well (one that
    # failed would have gone over gRPC again, and said so).
    opened = [line for line in router.lines if "stream over frames to" in line and "is open" in line]
    assert len(opened) >= 2 and not any("over gRPC again" in line for line in router.lines), "".join(router.lines)

    # A multiplexing client's stream to the router goes over the router's frames port, under mTLS.
    async def multiplexed():
        async with AsyncClient(router.address, tls=client_tls(pki), multiplex=True) as client:
            ids = [t async for c in client.generate(prompt, max_tokens=12, temperature=0.0, timeout=30)
                   for t in c.token_ids]
            return ids, client.streams.frames
    ids, frames = asyncio.run(asyncio.wait_for(multiplexed(), 60))
    assert ids == got and frames is not None  # (None: it failed and went over gRPC)


@pytest.mark.parametrize("why, tls", [
    ("plaintext", None),
    ("no client certificate", "no_cert"),
    ("a certificate from another CA", "stranger"),
    ("the server's name not checked against its certificate", "no_override"),
])
def test_a_client_without_a_valid_certificate_is_refused(stack, pki, why, tls):
    router = stack[2]
    if tls == "no_cert":
        tls = TLSConfig(ca_file=pki["ca"], server_name=SERVER_NAME)
    elif tls == "stranger":
        tls = client_tls(pki, "stranger")
    elif tls == "no_override":  # 127.0.0.1 is not a name in the certificate
        tls = client_tls(pki, server_name=None)
    with pytest.raises(grpc.RpcError) as e:
        _generate(router.address, tls, [1, 2, 3])
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, why
    if tls is not None:  # the frames port refuses it too: no hello, whatever it would send
        assert asyncio.run(_frames_refused(router.address, pki, tls)), why
    assert _generate(router.address, client_tls(pki), [1, 2, 3]), "the stack still serves the valid client"


async def _frames_refused(address: str, pki, tls: TLSConfig) -> bool:
    async with aio_channel(address, client_tls(pki)) as channel:
        info = await generate_pb2_grpc.TextGenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    call = FramesOpener("127.0.0.1", info.frames_port, internal_pb2.FRAMES_SERVICE_GENERATE, tls)(_no_commands(), ())
    try:
        await call.initial_metadata()
    except grpc.aio.AioRpcError as e:
        return e.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        call.cancel()
    return False


async def _no_commands():
    await asyncio.Event().wait()
    yield


def _check_stack(router, prefill, decode, pki, timeout_s: int = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "baton.services.cli", "check-stack", "--target", router.address,
                           "--prefill-metrics", metrics_address(prefill), "--decode-metrics", metrics_address(decode),
                           "--timeout", str(timeout_s), "--tls-ca-file", pki["ca"], "--tls-cert-file", pki["client"],
                           "--tls-key-file", pki["client_key"], "--tls-server-name", SERVER_NAME],
                          capture_output=True, text=True, timeout=60)


def test_check_stack_sees_kv_blocks_move_over_tls(stack, pki):
    prefill, decode, router, _ = stack
    done = _check_stack(router, prefill, decode, pki)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "decodes pulled KV 1 time(s)" in done.stdout


def test_check_stack_fails_a_stack_that_decodes_prompts_itself(stack, pki):
    prefill, decode, _, decode_only = stack
    # It waits out --timeout for blocks that never move: a short one (the stack is warm by now).
    done = _check_stack(decode_only, prefill, decode, pki, timeout_s=8)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "no KV blocks moved from prefill to decode" in done.stderr


def test_the_http_front_speaks_https_with_the_same_files(stack, pki):
    router = stack[2]
    url = next(ln for ln in router.lines if ln.startswith("OpenAI API on ")).split()[3]
    assert url.startswith("https://")
    context = ssl.create_default_context(cafile=pki["ca"])
    context.check_hostname = False  # the certificate names baton.internal, the URL 127.0.0.1
    context.load_cert_chain(pki["client"], pki["client_key"])
    with urllib.request.urlopen(url + "/models", context=context, timeout=10) as resp:
        assert resp.status == 200
    bare = ssl.create_default_context(cafile=pki["ca"])
    bare.check_hostname = False
    with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError)):
        urllib.request.urlopen(url + "/models", context=bare, timeout=10).read()


def test_bad_tls_flags_are_named(tmp_path, pki, tiny_llama):
    with pytest.raises(ValueError, match="tls_cert_file and tls_key_file"):
        TLSConfig(key_file=pki["server_key"])
    with pytest.raises(ValueError, match="tls_ca_file: cannot read"):
        TLSConfig(ca_file=str(tmp_path / "missing.crt"))
    done = subprocess.run([sys.executable, "-m", "baton.services.cli", "serve", "--model", tiny_llama, "--port", "0",
                           "--tls-cert-file", pki["server"]], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "tls_cert_file and tls_key_file" in done.stderr


def test_baton_health_is_a_probe_that_speaks_tls(stack, pki):
    """What the chart's probes exec under TLS: 0 for a serving server, 1 otherwise."""
    router = stack[2]

    def health(*flags):
        return subprocess.run([sys.executable, "-m", "baton.services.cli", "health", "--target", router.address,
                               *flags], capture_output=True, text=True, timeout=60)

    ok = health("--tls-ca-file", pki["ca"], "--tls-cert-file", pki["client"], "--tls-key-file", pki["client_key"],
                "--tls-server-name", SERVER_NAME)
    assert ok.returncode == 0 and ok.stdout.startswith("SERVING"), ok.stdout + ok.stderr
    refused = health("--tls-ca-file", pki["ca"], "--tls-server-name", SERVER_NAME)  # no client certificate
    assert refused.returncode == 1
