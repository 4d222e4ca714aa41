"""A torch.distributed store whose waits poll, asking between looks whether to go on.

Rank 0 of a gloo group meets the other ranks inside ProcessGroupGloo's constructor, waiting on
the group's store for each rank's address, and a TCP store waits as long as its timeout (600 s)
for a key that a dead rank will never set. Through this store those waits look every 50 ms and
call `give_up` in between, which raises (naming the rank that died) to end the rendezvous at
once. torch calls a Python store's methods from C++; what `give_up` raises comes out of the
group's constructor as it was raised.
"""
from __future__ import annotations

import datetime
import time
from collections.abc import Callable

import torch.distributed as dist

_POLL_S = 0.05


class WatchedStore(dist.Store):
    def __init__(self, store: dist.Store, give_up: Callable[[], None]):
        """`store`: where the ranks meet; `give_up()`: raises when waiting longer is pointless."""
        super().__init__()
        self.store = store
        self.give_up = give_up

    def set(self, key: str, value: bytes | str) -> None:
        self.store.set(key, value)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self.store.get(key)

    def add(self, key: str, amount: int) -> int:
        return self.store.add(key, amount)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self.store.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self.store.check(keys)

    def delete_key(self, key: str) -> bool:
        return self.store.delete_key(key)

    def num_keys(self) -> int:
        return self.store.num_keys()

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        """Until every key is set (as long as the store's timeout, or `timeout`), unless
        `give_up` raises first."""
        limit = (timeout or self.store.timeout).total_seconds()
        deadline = time.monotonic() + limit
        while not self.store.check(keys):
            self.give_up()
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"waited {limit:g}s for the store's keys {keys}")
            time.sleep(_POLL_S)
