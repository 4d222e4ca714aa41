"""The processes a test or benchmark started, found from /proc (Linux)."""
from __future__ import annotations

import os

_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU seconds (every thread's) so far; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime (fields 14 and 15)


def descendants(pid: int) -> set[int]:
    """Every process under pid (each of its threads' children, and theirs)."""
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:  # gone meanwhile
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except OSError:
                continue
            found.update(children)
            todo.extend(children)
    return found
