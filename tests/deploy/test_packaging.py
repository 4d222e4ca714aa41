"""The distribution installs one import namespace, `baton`, and a `baton` console script."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_wheel_holds_only_the_baton_namespace(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), ROOT], check=True, capture_output=True)
    (wheel,) = [f for f in os.listdir(tmp_path) if f.endswith(".whl")]
    names = zipfile.ZipFile(tmp_path / wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"baton", next(t for t in top if t.endswith(".dist-info"))}
    for module in ("baton/engine/scheduler.py", "baton/kernels/attention.py", "baton/kv_transfer/base.py",
                   "baton/services/cli/main.py", "baton/services/server/server.py", "baton/services/router/router.py",
                   "baton/kernels/cpu/paged_attention.cpp"):
        assert module in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "baton = baton.services.cli:main" in zipfile.ZipFile(tmp_path / wheel).read(entry_points).decode()


def test_console_script_runs():
    exe = os.path.join(os.path.dirname(sys.executable), "baton")
    out = subprocess.run([exe, "--help"], check=True, capture_output=True, text=True).stdout
    assert "prepare-models" in out and "generate" in out
