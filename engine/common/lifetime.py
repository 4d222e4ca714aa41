"""A child process that must not outlive its parent (an engine core, a tensor-parallel rank), and
that leaves Ctrl-C to it.

`python -m baton.engine.common.lifetime MODULE` (child_argv) runs MODULE as `python -m MODULE`
would, with SIGINT ignored from its first line, before MODULE's imports (seconds of torch's): a
terminal's Ctrl-C reaches every process of its foreground group, and the parent, which gets it
too, stops the child in its order, so a KeyboardInterrupt in the child would only print a
traceback that says something broke. What the child starts inherits the ignored SIGINT.
"""
from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys


def child_argv(module: str) -> list[str]:
    """The command line of a child process that runs `module` as its main module, SIGINT ignored."""
    return [sys.executable, "-m", "baton.engine.common.lifetime", module]


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when `parent` dies (PR_SET_PDEATHSIG); exit now if it already has.
    Callers still check os.getppid() now and then: the signal is Linux's only."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the caller's parent check ends it
        pass
    if os.getppid() != parent:  # the parent died before the signal was set
        os._exit(1)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    runpy.run_module(sys.argv.pop(1), run_name="__main__", alter_sys=True)
