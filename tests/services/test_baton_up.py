"""`baton up`: the whole stack from one command answers over gRPC and the OpenAI front, invites
a request once (after every service serves), prints each request's trace waterfall, stops
cleanly, and fails clearly on a bad model, a taken port or an engine that cannot start. Each
tier gets its own tensor parallel size: its engines' flag, their GPUs, the threads per rank, and
a refusal of sizes that could not exchange KV."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import openai
import pytest
from servers import Up, baton

from baton.services.cli import launcher, placement
from baton.services.cli.launcher import Service, Stack, build_stack, free_port
from baton.services.cli.main import build_parser, main
from baton.services.cli.placement import Placement, place_engines
from baton.testing.processes import descendants


def waterfalls(lines: list[str]) -> list[list[list[str]]]:
    """The (tier, phase) rows of each complete waterfall `baton up --trace` printed."""
    found, rows = [], None
    for line in list(lines):
        if line.startswith("trace "):
            rows = []
        elif rows is not None and line == "\n":
            found.append(rows)
            rows = None
        elif rows is not None and line.startswith("  "):
            rows.append(line.split()[:2])
    return found


def test_baton_up_answers_traces_and_stops_cleanly(tiny_llama):
    port, http_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    up = baton("up", "--model", tiny_llama, "--port", str(port), "--dtype", "float32", "--trace",
               "--http-port", str(http_port))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(up.stdout), daemon=True)  # never blocks the test
    reader.start()

    def wait_for(pattern: str, timeout: float = 120) -> list[str]:
        deadline = time.monotonic() + timeout
        while not any(line.startswith(pattern) for line in lines):
            assert time.monotonic() < deadline and up.poll() is None, "".join(lines)
            time.sleep(0.1)
        return lines[next(i for i, line in enumerate(lines) if line.startswith(pattern)):]

    try:
        wait_for("Baton is up")
        # One invitation, after every service said it serves: the children print none of their own.
        invites = [i for i, line in enumerate(lines) if "baton generate --target" in line]
        serving = [i for i, line in enumerate(lines) if "serving on " in line]
        up_at = next(i for i, line in enumerate(lines) if line.startswith("Baton is up"))
        assert len(invites) == 1 and invites[0] > up_at and len(serving) == 3 and max(serving) < up_at, "".join(lines)
        pids = [int(x) for x in subprocess.run(["pgrep", "-P", str(up.pid)], capture_output=True,
                                                text=True).stdout.split()]
        assert len(pids) == 3
        metrics = [line.split()[1] for line in wait_for("Metrics:")[1:4]]
        assert all(urllib.request.urlopen(url, timeout=10).read().startswith(b"#") for url in metrics)
        assert metrics[0] == f"http://127.0.0.1:{http_port}/metrics"  # the router's: on its API port, as vLLM's
        answer = subprocess.run([sys.executable, "-m", "baton.services.cli", "generate", "--target",
                                 f"127.0.0.1:{port}", "--raw", "--max-tokens", "5", "hello"],
                                capture_output=True, text=True, timeout=60)
        assert answer.returncode == 0 and "5 tokens" in answer.stderr, answer.stderr
        assert any(line.startswith(f"OpenAI API: http://127.0.0.1:{http_port}/v1") for line in lines)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none", max_retries=0)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=client.models.list().data[0].id, prompt="hello", max_tokens=5, temperature=0, stream=True))
        assert streamed == answer.stdout  # what `baton generate --raw` printed
        wait_for("trace ", 30)
        want = (["router", "request"], ["prefill", "compute"], ["decode", "transfer"], ["prefill", "hold"])
        deadline = time.monotonic() + 20
        # One of the two requests' waterfalls (a blank line ends each) shows every tier's phases;
        # on a loaded machine a tier's spans may come after the first one was printed.
        while not any(all(p in phases for p in want) for phases in waterfalls(lines)):
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
        time.sleep(0.2)
        assert not [pid for pid in pids
                    if subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode == 0]
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def test_baton_up_fails_clearly(tiny_llama, tmp_path):
    bad = baton("up", "--model", str(tmp_path / "nowhere"), "--port", str(free_port("127.0.0.1")))
    out, _ = bad.communicate(timeout=60)
    assert bad.returncode == 2 and "not a checkpoint directory" in out
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        bad = baton("up", "--model", tiny_llama, "--port", str(taken.getsockname()[1]))
        out, _ = bad.communicate(timeout=60)
    assert bad.returncode == 2 and "is taken" in out
    # An engine that dies at start-up (a context longer than the model's) stops the rest.
    bad = baton("up", "--model", tiny_llama, "--port", str(free_port("127.0.0.1")), "--max-model-len", "999999")
    out, _ = bad.communicate(timeout=120)
    assert bad.returncode == 1 and "exited with status" in out and "max_model_len" in out, out
    # Its children (reparented once it exited) carry the flag as one argument; none is left.
    assert subprocess.run(["pgrep", "-f", "max-model-len=999999"], capture_output=True).stdout == b""


# --- tensor parallelism per tier ---------------------------------------------------------------


def up_args(monkeypatch, tmp_path, gpus: int, *flags: str):
    """`baton up FLAGS` as main() handles them with `gpus` GPUs visible, stopping where the stack
    would start: (exit code or message, the placements and engine flags it would have started)."""
    started = {}

    def fake_up(model, host, port, num_prefill, num_decode, engine_argv, *args, placements=None, **kwargs):
        started.update(placements=placements, argv=engine_argv, router_argv=kwargs.get("router_argv"))
        return 0
    monkeypatch.setattr(launcher, "up", fake_up)
    monkeypatch.setattr(placement, "visible_gpus", lambda: gpus)
    with pytest.raises(SystemExit) as exit_:
        main(["up", "--model", str(tmp_path), *flags])
    return exit_.value.code, started


@pytest.mark.parametrize("flags,want", [
    ((), [1, 1]),
    (("--tensor-parallel-size", "2"), [2, 2]),  # the shared flag: both tiers
    (("--tensor-parallel-size", "2", "--decode-tensor-parallel-size", "1"), [2, 1]),  # a tier's own wins
    (("--prefill-tensor-parallel-size", "1", "--decode-tensor-parallel-size", "4"), [1, 4]),
    (("--prefill", "0", "--prefill-tensor-parallel-size", "2", "--decode-tensor-parallel-size", "3"), [3]),
])
def test_each_tier_gets_its_own_tensor_parallel_size(monkeypatch, tmp_path, flags, want):
    code, started = up_args(monkeypatch, tmp_path, 0, "--dtype", "float32", *flags)
    assert code == 0
    assert [p.tensor_parallel_size for p in started["placements"]] == want
    # Not among the flags every engine gets: each engine's comes with its placement.
    assert started["argv"] == ["--dtype=float32"]


@pytest.mark.parametrize("flags,want", [
    ((), [None, None]),
    (("--kv-cache-dtype", "fp8"), ["fp8", "fp8"]),  # the shared flag: both tiers
    (("--decode-kv-cache-dtype", "fp8"), [None, "fp8"]),  # an FP8 decode behind a prefill of the compute dtype
    (("--kv-cache-dtype", "fp8_e5m2", "--prefill-kv-cache-dtype", "bfloat16"), ["bfloat16", "fp8_e5m2"]),
])
def test_each_tier_gets_its_own_kv_cache_dtype(monkeypatch, tmp_path, flags, want):
    code, started = up_args(monkeypatch, tmp_path, 0, "--dtype", "float32", *flags)
    assert code == 0
    assert [p.kv_cache_dtype for p in started["placements"]] == want
    assert started["argv"] == ["--dtype=float32"]  # each engine's comes with its placement
    parsed = [build_parser().parse_args(["serve", *p.argv()]) for p in started["placements"]]
    assert [a.kv_cache_dtype for a in parsed] == want


def test_stream_interval_goes_to_the_engines_and_router_workers_to_the_router(monkeypatch, tmp_path):
    code, started = up_args(monkeypatch, tmp_path, 0, "--stream-interval", "8", "--router-workers", "3")
    assert code == 0 and started["argv"] == ["--stream-interval=8"]
    assert build_parser().parse_args(["serve", *started["argv"]]).stream_interval == 8
    assert build_parser().parse_args(["serve", "--role", "router", *started["router_argv"]]).router_workers == 3


@pytest.mark.parametrize("gpus,flags,message", [
    (0, ("--prefill-tensor-parallel-size", "2", "--decode-tensor-parallel-size", "3"),
     "--prefill-tensor-parallel-size 2 and --decode-tensor-parallel-size 3: KV moves from prefill to decode engines "
     "only when one size divides the other"),
    (0, ("--tensor-parallel-size", "4", "--decode-tensor-parallel-size", "6"), "4 and --decode-tensor-parallel-size 6"),
    (0, ("--decode-tensor-parallel-size", "0",), "--decode-tensor-parallel-size 0: must be at least 1"),
    (1, ("--prefill-tensor-parallel-size", "2",),
     "prefill engines of tensor parallel size 2 need 2 GPUs each, 1 GPU visible"),
    (4, ("--decode-tensor-parallel-size", "2", "--decode-device", "cuda:0,cuda:3"),
     "--decode-device cuda:3: an engine of tensor parallel size 2 there needs cuda:3..cuda:4, 4 GPUs visible"),
    (2, ("--tensor-parallel-size", "2", "--device", "cuda:1"), "--device cuda:1: an engine of tensor parallel size 2"),
])
def test_tensor_parallel_sizes_that_cannot_work_are_refused_before_anything_starts(monkeypatch, tmp_path, gpus,
                                                                                  flags, message):
    code, started = up_args(monkeypatch, tmp_path, gpus, *flags)
    assert code.startswith("baton up: ") and message in code, code
    assert not started


def test_an_engine_of_tp_n_takes_n_consecutive_gpus():
    roles = ["prefill", "decode", "decode"]
    got = place_engines(roles, None, {}, 4, None, {"prefill": 2, "decode": 1})
    assert got == [Placement("cuda:0", tensor_parallel_size=2), Placement("cuda:2"), Placement("cuda:3")]
    assert got[0].gpus() == {"cuda:0", "cuda:1"} and got[1].gpus() == {"cuda:2"}
    assert got[0].argv() == ["--device", "cuda:0", "--tensor-parallel-size", "2"]
    assert [p.summary() for p in got] == [" on cuda:0-1 (TP 2)", " on cuda:2", " on cuda:3"]
    assert Placement(None, tensor_parallel_size=2).summary() == " (TP 2)" and Placement(None).summary() == ""
    # Decode engines of TP 2 after a prefill of TP 1: blocks of two from where the GPUs before end.
    got = place_engines(roles, None, {}, 5, None, {"prefill": 1, "decode": 2})
    assert [(p.device, p.tensor_parallel_size) for p in got] == [("cuda:0", 1), ("cuda:1", 2), ("cuda:3", 2)]
    # A tier's devices are the bases of its engines' blocks.
    got = place_engines(["decode", "decode"], None, {"decode": "cuda:0,cuda:2"}, 4, None, {"decode": 2})
    assert [p.gpus() for p in got] == [{"cuda:0", "cuda:1"}, {"cuda:2", "cuda:3"}]
    # On CPU every rank is a process on the same cores: no device, the size alone.
    assert place_engines(roles, None, {}, 0, None, {"prefill": 2, "decode": 1}) == [
        Placement(None, tensor_parallel_size=2), Placement(None), Placement(None)]


def test_engines_whose_ranks_share_a_gpu_split_it_and_start_one_at_a_time():
    """Too few GPUs for every block: the engines start over at cuda:0 and share, as engines of one
    rank do; a GPU any of an engine's ranks shares counts, not only its first."""
    got = place_engines(["prefill", "decode", "decode"], None, {}, 3, 0.8, {"prefill": 2, "decode": 1})
    assert got == [Placement("cuda:0", True, 0.4, 2), Placement("cuda:2"), Placement("cuda:0", True, 0.4)]
    # A decode on cuda:1 shares the second GPU of a prefill based on cuda:0.
    got = place_engines(["prefill", "decode"], None, {"decode": "cuda:1"}, 2, None, {"prefill": 2})
    assert got == [Placement("cuda:0", True, 0.45, 2), Placement("cuda:1", True, 0.45)]
    prefill, decode, other = (Service(name, "x", "127.0.0.1:1", [], placement=p)
                              for name, p in (("p", got[0]), ("d", got[1]), ("o", Placement("cuda:5"))))
    assert Stack._gpu_busy(decode, [prefill])  # not started yet: the decode waits
    assert not Stack._gpu_busy(decode, [other]) and not Stack._gpu_busy(other, [prefill, decode])


def test_engine_command_lines_carry_their_tiers_size(tmp_path):
    placements = place_engines(["prefill", "decode", "decode"], None, {}, 4, None, {"prefill": 2, "decode": 1})
    stack = build_stack(str(tmp_path), "127.0.0.1", free_port("127.0.0.1"), 1, 2, ["--dtype=float32"], "round_robin",
                        placements=placements)
    router, *engines = stack.services
    parsed = {s.name: build_parser().parse_args(s.argv[3:]) for s in stack.services}  # after `python -m baton...`
    assert [(parsed[s.name].role, parsed[s.name].device, parsed[s.name].tensor_parallel_size) for s in engines] == [
        ("prefill", "cuda:0", 2), ("decode", "cuda:2", None), ("decode", "cuda:3", None)]
    assert all(parsed[s.name].dtype == "float32" for s in engines)
    assert parsed["router"].tensor_parallel_size is None
    assert stack.num_ranks() == 4


def test_the_stack_s_ports_never_repeat_one_already_given(monkeypatch, tmp_path):
    """A port free when asked can be one already given (the public one: nobody binds it before
    its service starts): each service still gets a port of its own."""
    handed = iter([5000, 5001, 5001, 5002, 5000, 5003, 5004, 5005, 5006])  # the public port is 5000
    monkeypatch.setattr(launcher, "free_port", lambda host: next(handed))
    stack = build_stack(str(tmp_path), "127.0.0.1", 5000, 1, 1, [], "round_robin")
    parsed = [build_parser().parse_args(s.argv[3:]) for s in stack.services]
    ports = [p for args in parsed for p in (args.port, args.metrics_port)]
    assert len(ports) == len(set(ports)) == 6 and parsed[0].port == 5000


@pytest.mark.parametrize("prefill_tp,decode_tp,threads", [(1, 1, "4"), (2, 2, "2"), (2, 1, "2"), (4, 4, "1")])
def test_cpu_threads_are_split_over_ranks_not_engines(monkeypatch, tmp_path, prefill_tp, decode_tp, threads):
    """Every rank is a process with its own torch threads: OMP_NUM_THREADS counts them."""
    (tmp_path / "config.json").write_text("{}")
    env = {}
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(launcher.os, "cpu_count", lambda: 8)
    monkeypatch.setattr(launcher.signal, "signal", lambda *args: None)  # pytest keeps its own Ctrl-C
    monkeypatch.setattr(Stack, "start", lambda self, e: env.update(e))

    def stop_here(self, timeout_s, stopping=None):
        raise RuntimeError("stopped by the test")
    monkeypatch.setattr(Stack, "wait_serving", stop_here)
    placements = [Placement(None, tensor_parallel_size=prefill_tp), Placement(None, tensor_parallel_size=decode_tp)]
    assert launcher.up(str(tmp_path), "127.0.0.1", free_port("127.0.0.1"), 1, 1, [], placements=placements) == 1
    assert env["OMP_NUM_THREADS"] == threads


def test_baton_up_runs_a_tensor_parallel_tier(tiny_llama):
    """A decode engine of two ranks (gloo, on CPU) behind the router answers, and its rank goes
    with the stack."""
    port = free_port("127.0.0.1")
    up = Up("--model", tiny_llama, "--port", str(port), "--http-port", "0", "--dtype", "float32", "--prefill", "0",
            "--decode-tensor-parallel-size", "2")
    try:
        assert "(TP 2)" in up.wait_for(r"^Baton is up.*").group(0)
        ranks = [pid for pid in descendants(up.proc.pid)
                 if "baton.engine.worker.parallel.rank" in open(f"/proc/{pid}/cmdline").read()]
        assert len(ranks) == 1
        answer = subprocess.run([sys.executable, "-m", "baton.services.cli", "generate", "--target",
                                 f"127.0.0.1:{port}", "--raw", "--max-tokens", "5", "hello"],
                                capture_output=True, text=True, timeout=60)
        assert answer.returncode == 0 and "5 tokens" in answer.stderr, answer.stderr
        assert up.stop() == 0
        time.sleep(0.2)
        assert subprocess.run(["kill", "-0", str(ranks[0])], capture_output=True).returncode != 0
    finally:
        if up.proc.poll() is None:
            up.proc.kill()
            up.proc.wait()

