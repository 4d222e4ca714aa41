"""Which device each engine of `baton up` runs on, its ranks, and its share of a GPU it shares.

An engine's device comes from its tier's list (`--prefill-device`, `--decode-device`: one
device, or several, comma-separated, given to the tier's engines in turn), else from
`--device`; else, with several GPUs visible, engines take one GPU each in turn (prefill
first), as the tiers are meant to run apart; with one GPU, all share it; with none, all run
on CPU. Engines that share a GPU split `--gpu-memory-utilization` (vLLM's per-engine share,
0.9 by default) evenly, and start one at a time, so that each measures its own memory use
without another loading beside it.

An engine of tensor parallel size N (`--prefill-tensor-parallel-size`,
`--decode-tensor-parallel-size`, else `--tensor-parallel-size`) runs its ranks on N consecutive
GPUs from its device (cuda:k..k+N-1, as the engine places them): its device must leave room for
them, and without one given, the engines take blocks of N GPUs in turn (starting over at cuda:0
where the rest is too short). A GPU shared by several engines' ranks is split as above. The two
tiers' sizes must let KV move between them: one divides the other.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from baton.engine.common.config import EngineConfig

DEFAULT_UTILIZATION = EngineConfig.defaults()["gpu_memory_utilization"]


@dataclass(frozen=True, slots=True)
class Placement:
    device: str | None  # None: the engine's default (auto)
    shares_gpu: bool = False
    utilization: float | None = None  # None: the engine's own --gpu-memory-utilization
    tensor_parallel_size: int = 1  # its ranks, on GPUs device..device+N-1
    kv_cache_dtype: str | None = None  # its tier's own (--prefill-kv-cache-dtype); None: the shared flag's

    def argv(self) -> list[str]:
        extra = ["--device", self.device] if self.device else []
        if self.kv_cache_dtype is not None:
            extra += [f"--kv-cache-dtype={self.kv_cache_dtype}"]
        if self.utilization is not None:
            extra += ["--gpu-memory-utilization", f"{self.utilization:.4g}"]
        if self.tensor_parallel_size != 1:
            extra += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        return extra

    def gpus(self) -> frozenset[str]:
        """The GPUs its ranks use (none on CPU or the engine's default device)."""
        if not self.device or not self.device.startswith("cuda:"):
            return frozenset()
        base = int(self.device.split(":")[1])
        return frozenset(f"cuda:{base + rank}" for rank in range(self.tensor_parallel_size))

    def summary(self) -> str:
        """Where it runs, for the launcher's summary: " on cuda:2-3 (TP 2)", " on cpu", " (TP 2)", ""."""
        gpus = sorted(self.gpus(), key=lambda d: int(d.split(":")[1]))
        where = f"{gpus[0]}-{gpus[-1].split(':')[1]}" if len(gpus) > 1 else self.device
        ranks = f" (TP {self.tensor_parallel_size})" if self.tensor_parallel_size > 1 else ""
        return (f" on {where}" if where else "") + ranks


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def tier_tensor_parallel(shared: int | None, prefill: int | None, decode: int | None,
                         num_prefill: int) -> dict[str, int]:
    """Each tier's tensor parallel size: its own flag, else the shared one, else 1. ValueError
    naming the flags when one is below 1, or when both tiers run and neither size divides the
    other (KV moves between such engines only)."""
    sizes = {}
    for role, own in (("prefill", prefill), ("decode", decode)):
        size = own if own is not None else shared if shared is not None else 1
        if size < 1:
            flag = f"--{role}-tensor-parallel-size" if own is not None else "--tensor-parallel-size"
            raise ValueError(f"{flag} {size}: must be at least 1")
        sizes[role] = size
    small, large = sorted(sizes.values())
    if num_prefill and large % small:
        raise ValueError(f"--prefill-tensor-parallel-size {sizes['prefill']} and --decode-tensor-parallel-size "
                         f"{sizes['decode']}: KV moves from prefill to decode engines only when one size divides "
                         f"the other (e.g. 1 and 2, 2 and 4)")
    return sizes


def _normalized(device: str, flag: str, num_gpus: int, tensor_parallel: int = 1) -> str:
    """cpu, or cuda:N with N..N+tensor_parallel-1 visible GPUs; ValueError naming the flag otherwise."""
    name = device.strip()
    if name == "cpu":
        return name
    kind, _, index = name.partition(":")
    if kind != "cuda" or not (index == "" or index.isdigit()):
        raise ValueError(f"{flag} {device}: must be cpu, cuda or cuda:N")
    index = int(index or 0)
    if index >= num_gpus:
        raise ValueError(f"{flag} {device}: {_visible(num_gpus)}")
    if index + tensor_parallel > num_gpus:
        raise ValueError(f"{flag} {device}: an engine of tensor parallel size {tensor_parallel} there needs "
                         f"cuda:{index}..cuda:{index + tensor_parallel - 1}, {_visible(num_gpus)}")
    return f"cuda:{index}"


def _visible(num_gpus: int) -> str:
    return f"{num_gpus} GPU{'s' if num_gpus != 1 else ''} visible"


def place_engines(roles: list[str], device: str | None, tier_devices: dict[str, str | None], num_gpus: int,
                  utilization: float | None = None, tensor_parallel: dict[str, int] | None = None) -> list[Placement]:
    """One Placement per engine, in start order (`roles`: each engine's tier; `tensor_parallel`:
    each tier's tensor parallel size, 1 where missing)."""
    tp = {role: (tensor_parallel or {}).get(role, 1) for role in {*roles, *tier_devices}}
    tiers = {role: [_normalized(d, f"--{role}-device", num_gpus, tp[role]) for d in listed.split(",")]
             for role, listed in tier_devices.items() if listed}  # every one checked, used or not
    taken = Counter()
    devices = []
    position = 0  # GPUs the engines before this one would take, one block each
    for role in roles:
        if role in tiers:
            devices.append(tiers[role][taken[role] % len(tiers[role])])
            taken[role] += 1
        elif device and device != "auto":
            devices.append(_normalized(device, "--device", num_gpus, tp[role]))
        elif num_gpus:
            if tp[role] > num_gpus:
                raise ValueError(f"{role} engines of tensor parallel size {tp[role]} need {tp[role]} GPUs each, "
                                 f"{_visible(num_gpus)}: lower --{role}-tensor-parallel-size, or run them on CPU "
                                 f"(--{role}-device cpu)")
            base = position % num_gpus
            devices.append(f"cuda:{base if base + tp[role] <= num_gpus else 0}")
        else:
            devices.append(None)
        position += tp[role]
    placed = [Placement(d, tensor_parallel_size=tp[role]) for d, role in zip(devices, roles)]
    sharing = Counter(gpu for p in placed for gpu in p.gpus())
    share = DEFAULT_UTILIZATION if utilization is None else utilization
    out = []
    for p in placed:
        most = max((sharing[gpu] for gpu in p.gpus()), default=1)
        out.append(Placement(p.device, True, share / most, p.tensor_parallel_size) if most > 1 else p)
    return out
