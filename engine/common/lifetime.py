"""A child process that must not outlive its parent (an engine core, a tensor-parallel rank)."""
from __future__ import annotations

import ctypes
import os
import signal


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when `parent` dies (PR_SET_PDEATHSIG); exit now if it already has.
    Callers still check os.getppid() now and then: the signal is Linux's only."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the caller's parent check ends it
        pass
    if os.getppid() != parent:  # the parent died before the signal was set
        os._exit(1)
