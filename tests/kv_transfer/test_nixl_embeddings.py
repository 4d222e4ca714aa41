"""Image embeddings over NIXL (kv_transfer/nixl_embeddings.py), two real agents in this process:
a READ gives the stored values (bfloat16 and float32 to float32), the reader's notification
lets the encoder reuse the slots, a store whose slots are all held refuses more, and whatever
goes wrong on the way is EmbeddingsUnavailable (the prefill then reads the images itself): a
slot reused by another image, an encoder that is not there, a READ past its time."""
from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

from baton.kv_transfer.nixl_embeddings import EmbeddingReader, EmbeddingStore, EmbeddingsUnavailable, StoreFull


@pytest.fixture
def agents():
    made = []

    def make(slots: int = 2, dtype=torch.bfloat16, hold_s: float = 30.0, serve: bool = True):
        store = EmbeddingStore(f"encoder-{uuid.uuid4().hex[:8]}", slots, 10, 6, dtype, hold_s)
        stop = threading.Event()
        poller = threading.Thread(target=store.serve, args=(stop,), daemon=True)
        if serve:
            poller.start()
        reader = EmbeddingReader(f"reader-{uuid.uuid4().hex[:8]}")
        made.append((store, stop, poller if serve else None, reader))
        return store, reader

    yield make
    for store, stop, poller, reader in made:
        stop.set()
        if poller is not None:
            poller.join()
        reader.close()
        store.close()


def read(reader: EmbeddingReader, store: EmbeddingStore, stored: list, tokens: list[int], timeout_s: float = 5.0):
    dtype = str(store.dtype).removeprefix("torch.")
    return reader.read(store.engine_id, store.agent_metadata,
                       [(s.digest, s.address, s.nbytes, dtype, n, store.hidden) for s, n in zip(stored, tokens)],
                       timeout_s)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_read_gives_the_stored_embeddings_and_lets_the_slots_go(agents, dtype):
    store, reader = agents(dtype=dtype)
    values = [torch.randn(7, 6), torch.randn(10, 6)]
    stored = [store.put(11, values[0]), store.put(22, values[1])]
    with pytest.raises(StoreFull):
        store.put(33, values[0])  # both slots held for the reader
    got = read(reader, store, stored, [7, 10])
    assert all(torch.equal(g, v.to(dtype).float()) for g, v in zip(got, values))
    deadline = time.monotonic() + 5
    while any(store.held_until):  # the reader's notification, taken by the poller, lets both go
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert store.lookup(11).address == stored[0].address and store.hits == 1  # kept: not encoded again, held again
    assert store.put(33, values[0]).address == stored[1].address  # the slot let go is reused
    with pytest.raises(StoreFull):
        store.put(44, values[0])

def test_a_slot_reused_by_another_image_is_unavailable(agents):
    store, reader = agents(slots=1, hold_s=0.01)
    first = store.put(11, torch.randn(7, 6))
    time.sleep(0.02)
    store.put(22, torch.randn(7, 6))  # the hold is over: the slot is another image's now
    with pytest.raises(EmbeddingsUnavailable, match="holds another image"):
        read(reader, store, [first], [7])


def test_an_encoder_that_is_not_there_or_too_slow_is_unavailable(agents):
    store, reader = agents(serve=False)  # (nobody makes progress on the store's side: the READ waits)
    stored = store.put(11, torch.randn(7, 6))
    with pytest.raises(EmbeddingsUnavailable, match="more than 0.2 s"):
        read(reader, store, [stored], [7], timeout_s=0.2)
    with pytest.raises(EmbeddingsUnavailable):
        reader.read("gone", b"not an agent's metadata", [(11, stored.address, stored.nbytes, "bfloat16", 7, 6)], 1.0)
