"""The engine's snapshot on the wire, in one place: the public Load (GetLoad, WatchLoad, the
router's view) and the internal EngineStats (Admin.Stats, with the KV connector's counters)."""
from __future__ import annotations

from baton.engine.common.core_messages import CoreStats
from baton.engine.common.stats import EngineSnapshot
from baton.v1 import generate_pb2 as pb
from baton.v1 import internal_pb2


def load_to_proto(snapshot: EngineSnapshot, role: str, address: str, num_in_flight: int) -> pb.Load:
    return pb.Load(role=role, address=address, num_running=snapshot.num_running, num_waiting=snapshot.num_waiting,
                   num_waiting_for_remote_kvs=snapshot.num_waiting_for_kvs, kv_cache_usage=snapshot.kv_cache_usage,
                   num_held_blocks=snapshot.num_held_blocks, num_in_flight=num_in_flight,
                   num_host_kv_blocks=snapshot.num_host_kv_blocks, host_kv_cache_usage=snapshot.host_kv_cache_usage,
                   host_kv_cache_hits=snapshot.host_kv_cache_hits, num_swapped=snapshot.num_swapped)


def stats_to_proto(s: CoreStats, role: str, num_in_flight_streams: int, num_requests: int, engine_core_pid: int,
                   ) -> internal_pb2.EngineStats:
    """`num_requests`: admitted by the front since start (the core counts only those it took)."""
    snap = s.snapshot
    return internal_pb2.EngineStats(
        engine_id=s.engine_id, role=role, num_kv_blocks=snap.num_kv_blocks, num_free_kv_blocks=snap.num_free_kv_blocks,
        num_running=snap.num_running, num_waiting=snap.num_waiting, num_held=snap.num_held_requests,
        num_in_flight_streams=num_in_flight_streams, num_prefix_hit_tokens=snap.prefix_cache_hits,
        num_expired_holds=s.num_expired_holds, num_failed_loads=snap.num_failed_loads,
        num_blocks_pulled=s.num_blocks_pulled, num_requests=num_requests, engine_core_pid=engine_core_pid,
        num_host_kv_blocks=snap.num_host_kv_blocks, num_free_host_kv_blocks=snap.num_free_host_kv_blocks,
        num_host_hand_offs=snap.num_host_hand_offs, num_bytes_pulled=s.num_bytes_pulled)
