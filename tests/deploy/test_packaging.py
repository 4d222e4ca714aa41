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
    # Every module the repository tracks is in it (a subpackage missing from pyproject's list is not).
    tracked = subprocess.run(["git", "ls-files", "engine", "kernels", "kv_transfer", "services", "baton"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    want = {f if f.startswith("baton/") else "baton/" + f for f in tracked if f.endswith((".py", ".cpp"))}
    assert want and not sorted(want - set(names)), sorted(want - set(names))
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "baton = baton.services.cli:main" in zipfile.ZipFile(tmp_path / wheel).read(entry_points).decode()


def test_console_script_runs():
    exe = os.path.join(os.path.dirname(sys.executable), "baton")
    out = subprocess.run([exe, "--help"], check=True, capture_output=True, text=True).stdout
    assert "prepare-models" in out and "generate" in out
