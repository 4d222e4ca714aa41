"""One writer, several readers, over shared memory: how an engine core hands each step to its
tensor-parallel ranks (as vLLM's multiproc executor does), one copy of the message for all.

A ring of slots in one file under /dev/shm. The writer pickles a message, writes it in slot-sized
chunks, and publishes each chunk by bumping the slot's sequence number last; a reader copies a
chunk out once the sequence says it is there, then bumps its own count, which lets the writer
reuse the slot. Each counter has one writer, so no locks: a fence (a lock taken and dropped, a
full barrier on every CPU) keeps a chunk's bytes and its size ahead of its sequence number. The
sequence number is written on its own, after the size: struct's pack_into zeroes what it packs
and then writes it field by field, so a reader that saw the new sequence amid one packing of
both could read the size as 0 (an empty message).

The file is unlinked as soon as every reader has it mapped (`unlink`), so a process killed later
leaves nothing behind in /dev/shm.

Waiting spins for a while (a step's message follows the last one by well under a millisecond
while an engine is busy), then sleeps in growing steps up to a millisecond (an idle engine costs
its ranks almost nothing), and asks `alive()` every so often so that a dead peer is an error, not
a hang.
"""
from __future__ import annotations

import mmap
import os
import pickle
import struct
import tempfile
import threading
import time
import uuid
from collections.abc import Callable

# A slot's head: its sequence number (chunks published so far), then the chunk's size and whether
# more chunks follow.
_SEQ = struct.Struct("<Q")
_CHUNK = struct.Struct("<II")
_HEAD_BYTES = _SEQ.size + _CHUNK.size
_COUNT = struct.Struct("<Q")
_SPIN_S = 0.002  # wait without sleeping this long first
_LONGEST_SLEEP_S = 0.001
_ALIVE_EVERY_S = 0.1
_fence_lock = threading.Lock()


class PeerGone(RuntimeError):
    """The process on the other side of the ring died."""


def _fence() -> None:
    with _fence_lock:
        pass


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class ShmBroadcast:
    def __init__(self, path: str, num_readers: int, slots: int, slot_bytes: int, create: bool):
        self.path, self.num_readers, self.slots, self.slot_bytes = path, num_readers, slots, slot_bytes
        self._counts_at = slots * _HEAD_BYTES
        self._data_at = -(-(self._counts_at + num_readers * _COUNT.size) // 64) * 64
        size = self._data_at + slots * slot_bytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._buf = memoryview(self._map)
        self.count = 0  # chunks written (the writer) or read (a reader) so far
        self.reader = -1
        self.num_bytes = 0  # payload bytes sent or received so far

    @classmethod
    def create(cls, num_readers: int, slots: int = 4, slot_bytes: int = 1 << 20, reader: int = -1) -> ShmBroadcast:
        """A new ring for num_readers readers (zeroed by ftruncate); this end writes, or with
        `reader` reads as that reader (a ring another process writes to)."""
        path = os.path.join(_shm_dir(), f"baton-tp-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        ring = cls(path, num_readers, slots, slot_bytes, create=True)
        ring.reader = reader
        return ring

    @classmethod
    def attach(cls, path: str, num_readers: int, reader: int, slots: int = 4,
               slot_bytes: int = 1 << 20) -> ShmBroadcast:
        """Reader `reader`'s end of a ring another process made (the same slots and
        slot_bytes), or with reader -1 its writing end."""
        ring = cls(path, num_readers, slots, slot_bytes, create=False)
        ring.reader = reader
        return ring

    def unlink(self) -> None:
        """Remove the file (every end mapped stays usable)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self._buf.release()
        self._map.close()

    # ---- writer ------------------------------------------------------------------------------
    def send(self, message: object, alive: Callable[[], bool] = lambda: True) -> None:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self.num_bytes += len(payload)
        chunks = range(0, max(len(payload), 1), self.slot_bytes)
        for i, start in enumerate(chunks):
            chunk = payload[start:start + self.slot_bytes]
            slot = self.count % self.slots
            oldest = self.count - self.slots  # the chunk this slot held: every reader must be past it
            _wait(lambda n=oldest: self._slowest_reader() > n, alive, "a tensor-parallel rank")
            at = self._data_at + slot * self.slot_bytes
            self._buf[at:at + len(chunk)] = chunk
            _fence()
            head = slot * _HEAD_BYTES
            _CHUNK.pack_into(self._buf, head + _SEQ.size, len(chunk), i < len(chunks) - 1)
            _fence()
            _SEQ.pack_into(self._buf, head, self.count + 1)
            self.count += 1

    def _slowest_reader(self) -> int:
        return min(_COUNT.unpack_from(self._buf, self._counts_at + r * _COUNT.size)[0]
                   for r in range(self.num_readers))

    # ---- reader ------------------------------------------------------------------------------
    def poll(self) -> bool:
        """Whether a message is there to receive."""
        return _SEQ.unpack_from(self._buf, (self.count % self.slots) * _HEAD_BYTES)[0] == self.count + 1

    def recv(self, alive: Callable[[], bool] = lambda: True) -> object:
        parts = []
        while True:
            slot = self.count % self.slots
            head = slot * _HEAD_BYTES
            _wait(lambda h=head, n=self.count + 1: _SEQ.unpack_from(self._buf, h)[0] == n, alive,
                  "the engine core")
            _fence()
            size, more = _CHUNK.unpack_from(self._buf, head + _SEQ.size)
            at = self._data_at + slot * self.slot_bytes
            parts.append(bytes(self._buf[at:at + size]))
            _fence()
            self.count += 1
            _COUNT.pack_into(self._buf, self._counts_at + self.reader * _COUNT.size, self.count)
            if not more:
                break
        payload = parts[0] if len(parts) == 1 else b"".join(parts)
        self.num_bytes += len(payload)
        return pickle.loads(payload)


def _wait(ready: Callable[[], bool], alive: Callable[[], bool], peer: str) -> None:
    if ready():
        return
    start = time.perf_counter()
    while time.perf_counter() - start < _SPIN_S:
        if ready():
            return
    sleep, asked = 1e-5, time.perf_counter()
    while not ready():
        time.sleep(sleep)
        sleep = min(sleep * 2, _LONGEST_SLEEP_S)
        if time.perf_counter() - asked > _ALIVE_EVERY_S:
            if not alive():
                raise PeerGone(f"{peer} exited")
            asked = time.perf_counter()
