"""Image embeddings over NIXL, from an encoder tier to the prefill that runs the prompt (E/P/D).

The encoder's half (`EmbeddingStore`): host memory registered with its agent, cut in slots that
each hold one image's embeddings behind an 8-byte header of the image's digest; a slot is kept
by digest (a second request with the same image is not encoded again) and is held, never
reused, for `hold_s` after it was handed out or until its reader says it is done, whichever
comes first. The reader's half (`EmbeddingReader`): one READ for a request's images into memory
of its own, each header checked against the digest the handle names, then a notification that
lets the encoder reuse the slots. Whatever fails (the encoder gone, a slot reused after its hold,
a READ past its time) raises EmbeddingsUnavailable: the caller reads and encodes the images
itself."""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from baton.kv_transfer.nixl_connector import new_agent

HEADER_BYTES = 8  # the image's digest, little-endian, before its embeddings
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EmbeddingsUnavailable(Exception):
    """The embeddings could not be read; the reason says why."""


class StoreFull(Exception):
    """Every slot is held for a reader."""


@dataclass(slots=True, frozen=True)
class StoredImage:
    """Where one image's embeddings lie in the store: `address` of the header, `nbytes` with it."""
    digest: int
    address: int
    nbytes: int


class EmbeddingStore:
    def __init__(self, engine_id: str, slots: int, slot_tokens: int, hidden: int, dtype: torch.dtype,
                 hold_s: float, agent=None):
        """`slots` images of at most `slot_tokens` tokens of `hidden` values of `dtype` each;
        `agent`: a nixl_agent (default: a new one named `engine_id`)."""
        self.engine_id, self.hidden, self.dtype, self.hold_s = engine_id, hidden, dtype, hold_s
        self.slot_bytes = HEADER_BYTES + slot_tokens * hidden * dtype.itemsize
        self.buffer = torch.zeros(slots * self.slot_bytes, dtype=torch.uint8)
        self.agent = agent or new_agent(engine_id)
        self._reg = self.agent.register_memory(self.buffer)
        self.agent_metadata = self.agent.get_agent_metadata()
        self.by_digest: OrderedDict[int, int] = OrderedDict()  # digest -> slot, least recently handed out first
        self.held_until = [0.0] * slots
        self.tokens = [0] * slots  # each slot's image's
        self.slot_tokens = slot_tokens
        self.free = list(range(slots))
        self.hits = 0  # images found held already, not encoded again
        self._lock = threading.Lock()
        self._wake = threading.Event()  # a slot was handed out: a READ is coming

    def lookup(self, digest: int) -> StoredImage | None:
        """The image's slot, held again for a reader, when it is stored."""
        with self._lock:
            slot = self.by_digest.get(digest)
            if slot is None:
                return None
            self.hits += 1
            self.by_digest.move_to_end(digest)
            self._hold(slot)
            return self._stored(digest, slot, self.tokens[slot])

    def put(self, digest: int, embeddings: torch.Tensor) -> StoredImage:
        """Store an image's embeddings [tokens, hidden] and hold them for a reader; raises
        StoreFull when every slot is held."""
        if embeddings.shape[0] > self.slot_tokens:
            raise ValueError(f"an image of {embeddings.shape[0]} tokens does not fit a slot of {self.slot_tokens}")
        data = embeddings.detach().to("cpu", self.dtype).contiguous().view(torch.uint8).flatten()
        with self._lock:
            slot = self._take_slot()
            at = slot * self.slot_bytes
            header = bytearray(digest.to_bytes(HEADER_BYTES, "little"))
            self.buffer[at:at + HEADER_BYTES] = torch.frombuffer(header, dtype=torch.uint8)
            self.buffer[at + HEADER_BYTES:at + HEADER_BYTES + data.numel()] = data
            self.by_digest[digest] = slot
            self.tokens[slot] = embeddings.shape[0]
            self._hold(slot)
            return self._stored(digest, slot, embeddings.shape[0])

    def _hold(self, slot: int) -> None:
        self.held_until[slot] = time.monotonic() + self.hold_s
        self._wake.set()

    def _take_slot(self) -> int:
        if self.free:
            return self.free.pop()
        now = time.monotonic()
        for digest, slot in self.by_digest.items():  # the least recently handed out that nobody holds
            if self.held_until[slot] <= now:
                del self.by_digest[digest]
                return slot
        raise StoreFull(f"all {len(self.held_until)} slots are held for readers")

    def _stored(self, digest: int, slot: int, tokens: int) -> StoredImage:
        return StoredImage(digest, self.buffer.data_ptr() + slot * self.slot_bytes,
                           HEADER_BYTES + tokens * self.hidden * self.dtype.itemsize)

    def serve(self, stop: threading.Event) -> None:
        """Poll until `stop`: every 0.5 ms while a slot is held (a reader's READ waits on this
        side's progress), else at the next hand-out or every 50 ms."""
        while not stop.is_set():
            self.poll()
            if any(t > time.monotonic() for t in self.held_until):
                time.sleep(0.0005)
            else:
                self._wake.wait(0.05)
                self._wake.clear()

    def poll(self) -> None:
        """Take readers' notifications (the digests they read) and let those slots go; this also
        keeps UCX progressing for transports that need the target to."""
        for notes in self.agent.get_new_notifs().values():
            for note in notes:
                digests = torch.frombuffer(bytearray(note), dtype=torch.int64).tolist() if len(note) % 8 == 0 else []
                with self._lock:
                    for digest in digests:
                        slot = self.by_digest.get(digest)
                        if slot is not None:
                            self.held_until[slot] = 0.0

    def close(self) -> None:
        if self._reg is not None:
            self.agent.deregister_memory(self._reg)
            self._reg = None


class EmbeddingReader:
    def __init__(self, name: str, agent=None):
        self.agent = agent or new_agent(name)
        self.peers: dict[str, str] = {}  # encoder id -> its agent's name here
        self.buffer: torch.Tensor | None = None
        self._reg = None
        self._lock = threading.Lock()  # one READ at a time into the buffer

    def read(self, encoder_id: str, agent_metadata: bytes, images: list[tuple[int, int, int, str, int, int]],
             timeout_s: float) -> list[torch.Tensor]:
        """Each image's embeddings [tokens, hidden] in float32, for (digest, address, nbytes,
        dtype, tokens, hidden) of an encoder's; raises EmbeddingsUnavailable."""
        with self._lock:
            try:
                data = self._read(encoder_id, agent_metadata, [(a, n) for _, a, n, *_ in images], timeout_s)
            except EmbeddingsUnavailable:
                raise
            except Exception as e:  # noqa: BLE001 - NIXL's own, for an unknown or gone agent: read the images
                self.peers.pop(encoder_id, None)
                raise EmbeddingsUnavailable(f"{type(e).__name__}: {e}") from None
            out, at = [], 0
            for digest, _, nbytes, dtype, tokens, hidden in images:
                header = int.from_bytes(data[at:at + HEADER_BYTES].numpy().tobytes(), "little")
                if header != digest:
                    raise EmbeddingsUnavailable(f"the encoder's slot for image {digest:x} holds another image now")
                values = data[at + HEADER_BYTES:at + nbytes].view(DTYPES[dtype])
                out.append(values.view(tokens, hidden).to(torch.float32, copy=True))
                at += nbytes
            note = torch.tensor([d for d, *_ in images], dtype=torch.int64).view(torch.uint8).numpy().tobytes()
            self.agent.send_notif(self.peers[encoder_id], note)  # the encoder may reuse the slots
            return out

    def _read(self, encoder_id: str, agent_metadata: bytes, regions: list[tuple[int, int]],
              timeout_s: float) -> torch.Tensor:
        peer = self.peers.get(encoder_id)
        if peer is None:
            peer = self.peers[encoder_id] = self.agent.add_remote_agent(agent_metadata)
        total = sum(n for _, n in regions)
        self._room(total)
        local, at = [], self.buffer.data_ptr()
        for _, n in regions:
            local.append((at, n, 0))
            at += n
        handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local, "DRAM"),
                                            self.agent.get_xfer_descs([(a, n, 0) for a, n in regions], "DRAM"),
                                            peer, b"")
        try:
            if self.agent.transfer(handle) == "ERR":
                raise EmbeddingsUnavailable("the READ could not start")
            deadline = time.monotonic() + timeout_s
            while (state := self.agent.check_xfer_state(handle)) == "PROC":
                if time.monotonic() > deadline:
                    raise EmbeddingsUnavailable(f"the READ took more than {timeout_s:.1f} s")
                time.sleep(0)
            if state != "DONE":
                raise EmbeddingsUnavailable(f"the READ failed ({state})")
        finally:
            self.agent.release_xfer_handle(handle)
        return self.buffer[:total]

    def _room(self, nbytes: int) -> None:
        """A registered buffer of at least nbytes (grown by doubling)."""
        if self.buffer is not None and self.buffer.numel() >= nbytes:
            return
        if self._reg is not None:
            self.agent.deregister_memory(self._reg)
        size = max(nbytes, 2 * (self.buffer.numel() if self.buffer is not None else 0), 1 << 20)
        self.buffer = torch.empty(size, dtype=torch.uint8)
        self._reg = self.agent.register_memory(self.buffer)

    def close(self) -> None:
        if self._reg is not None:
            self.agent.deregister_memory(self._reg)
            self._reg = None
