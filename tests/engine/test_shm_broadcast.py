"""The shared-memory ring that hands each step to an engine's tensor-parallel ranks: every reader
gets every message, in order, whole, also messages many slots long and while the writer laps the
ring; a writer never overwrites a slot a reader has not copied; a dead peer is an error, not a
hang; unlinked, the file is gone and the mapped ends still work."""
from __future__ import annotations

import os
import random
import threading

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
