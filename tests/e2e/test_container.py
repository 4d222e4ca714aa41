"""The container image, really built and run with podman (slow: opt-in with
BATON_TEST_CONTAINER=1): `baton up` inside it on the demo model, with a read-only root
filesystem, answers Generate from outside; it runs as non-root, uses the kernel built into
the image, and stops cleanly on SIGTERM."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from baton.services.cli.launcher import free_port
from baton.services.client import Client
from baton.services.rpc.health import is_serving

pytestmark = [pytest.mark.container,
              pytest.mark.skipif(os.environ.get("BATON_TEST_CONTAINER") != "1",
                                 reason="builds and runs the container image (minutes): BATON_TEST_CONTAINER=1")]

ROOT = Path(__file__).resolve().parents[2]
PODMAN = ["podman", "--storage-driver", "vfs", "--runtime", "runc", "--cgroup-manager", "cgroupfs"]


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, CONTAINERS_CONF=str(ROOT / "build/image/containers.conf"))
    return subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout, check=check, env=env)


@pytest.fixture(scope="module")
def image() -> str:
    t0 = time.monotonic()
    done = subprocess.run([str(ROOT / "deploy/build_image.sh")], capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-4000:]
    name, size = done.stdout.split()[:2]
    print(f"\nimage {name}: {size} MiB, built in {time.monotonic() - t0:.0f}s")
    return name


def test_baton_up_in_the_image_serves_generate_from_outside(image, smollm2):
    port = free_port("127.0.0.1")
    model = Path(smollm2)
    t0 = time.monotonic()
    cid = podman("run", "-d", "--network", "host", "--read-only", "-v", f"{model}:/models/{model.name}:ro",
                 image, "up", "--host", "127.0.0.1", "--port", str(port), "--http-port", "0").stdout.strip()
    try:
        address = f"127.0.0.1:{port}"
        while not is_serving(address):
            state = podman("inspect", cid, "--format", "{{.State.Running}}").stdout.strip()
            assert state == "true" and time.monotonic() - t0 < 300, podman("logs", cid, check=False).stdout
            time.sleep(0.5)
        started = time.monotonic() - t0
        t1 = time.monotonic()
        with Client(address) as client:
            chunks = list(client.generate([{"role": "user", "content": "What is the capital of France?"}],
                                          max_tokens=16, temperature=0.0, timeout=120))
        first_call = time.monotonic() - t1
        text = "".join(c.text for c in chunks)
        assert chunks[-1].finish_reason in ("stop", "length") and "Paris" in text, text

        # Every process in the container (seen from the host: no user namespace) runs as the
        # image's user, not root.
        pid1 = podman("inspect", cid, "--format", "{{.State.Pid}}").stdout.strip()
        pids = [pid1, *subprocess.run(["pgrep", "-P", pid1], capture_output=True, text=True).stdout.split()]
        uids = {next(line.split()[1] for line in open(f"/proc/{pid}/status") if line.startswith("Uid:"))
                for pid in pids}
        assert len(pids) == 4 and uids == {"10001"}, (pids, uids)  # baton up, router, prefill, decode
        out = podman("logs", cid)
        logs = out.stdout + out.stderr
        assert "PyTorch reference" not in logs, logs  # the kernel built into the image loaded

        t2 = time.monotonic()
        podman("stop", "--time", "30", cid, timeout=60)
        stopped = time.monotonic() - t2
        code = podman("inspect", cid, "--format", "{{.State.ExitCode}}").stdout.strip()
        assert code == "0" and stopped < 25, (code, stopped, podman("logs", cid, check=False).stderr[-3000:])
        print(f"\nserving {started:.1f}s after run; first Generate {first_call:.2f}s; stopped on SIGTERM in "
              f"{stopped:.1f}s (exit {code}); answer: {text!r}")
    finally:
        podman("rm", "-f", cid, check=False)
