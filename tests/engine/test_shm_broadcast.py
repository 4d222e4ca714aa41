"""The shared-memory ring that hands each step to an engine's tensor-parallel ranks: every reader
gets every message, in order, whole, also messages many slots long and while the writer laps the
ring; a writer never overwrites a slot a reader has not copied; a reader in another process
polling as fast as it can never sees a slot published before its size; a dead peer is an error,
not a hang; unlinked, the file is gone and the mapped ends still work."""
from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time

import pytest

from baton.engine.worker.parallel.shm_broadcast import PeerGone, ShmBroadcast


def test_every_reader_gets_every_message_in_order_across_chunks_and_laps():
    writer = ShmBroadcast.create(num_readers=2, slots=2, slot_bytes=64)
    readers = [ShmBroadcast.attach(writer.path, 2, r, slots=2, slot_bytes=64) for r in range(2)]
    writer.unlink()
    assert not os.path.exists(writer.path)
    rng = random.Random(3)
    messages = [{"step": i, "tokens": [rng.randrange(1000) for _ in range(rng.choice([0, 3, 40, 300]))]}
                for i in range(60)]
    got: list[list] = [[], []]

    def read(r: int) -> None:
        for _ in messages:
            got[r].append(readers[r].recv())

    threads = [threading.Thread(target=read, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for m in messages:
        writer.send(m)
    for t in threads:
        t.join(30)
    assert got == [messages, messages]
    assert writer.count > len(messages)  # the long ones took several slots
    for end in [writer, *readers]:
        end.close()


def test_a_reader_polling_another_process_never_reads_a_slot_before_its_size():
    """A writer process sends many small messages while this one polls as fast as it can. (Packed
    with its sequence number, a slot's size was zeroed and rewritten after the sequence: one
    message in about a hundred thousand came out empty. Here, up to two hundred thousand.)"""
    n = 200_000
    reader = ShmBroadcast.create(num_readers=1, reader=0)
    writer = subprocess.Popen([sys.executable, "-c", (
        "import sys\n"
        "from baton.engine.worker.parallel.shm_broadcast import ShmBroadcast\n"
        "ring = ShmBroadcast.attach(sys.argv[1], 1, -1)\n"
        f"for i in range({n}):\n"
        "    ring.send(i)\n"), reader.path])
    got = 0
    try:
        deadline = time.monotonic() + 15  # (a loaded machine reads fewer)
        while got < n and time.monotonic() < deadline:
            if not reader.poll():
                continue
            assert reader.recv() == got
            if got == 0:  # the writer has it mapped
                reader.unlink()
            got += 1
    finally:
        writer.kill()
        writer.wait()
        reader.unlink()
        reader.close()
    assert got > 10_000


def test_a_dead_peer_is_an_error_not_a_hang():
    writer = ShmBroadcast.create(num_readers=1, slots=2, slot_bytes=64)
    reader = ShmBroadcast.attach(writer.path, 1, 0, slots=2, slot_bytes=64)
    writer.unlink()
    with pytest.raises(PeerGone, match="the engine core exited"):
        reader.recv(alive=lambda: False)
    writer.send("a")
    writer.send("b")  # the ring is full now: the reader copied neither
    with pytest.raises(PeerGone, match="a tensor-parallel rank exited"):
        writer.send("c", alive=lambda: False)
    assert reader.recv() == "a" and reader.recv() == "b"
    writer.close()
    reader.close()
