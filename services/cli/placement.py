"""Which device each engine of `baton up` runs on, and its share of a GPU it shares.

An engine's device comes from its tier's list (`--prefill-device`, `--decode-device`: one
device, or several, comma-separated, given to the tier's engines in turn), else from
`--device`; else, with several GPUs visible, engines take one GPU each in turn (prefill
first), as the tiers are meant to run apart; with one GPU, all share it; with none, all run
on CPU. Engines that share a GPU split `--gpu-memory-utilization` (vLLM's per-engine share,
0.9 by default) evenly, and start one at a time, so that each measures its own memory use
without another loading beside it.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields

from baton.engine.common.config import EngineConfig

DEFAULT_UTILIZATION = next(f.default for f in fields(EngineConfig) if f.name == "gpu_memory_utilization")


@dataclass(frozen=True, slots=True)
class Placement:
    device: str | None  # None: the engine's default (auto)
    shares_gpu: bool = False
    utilization: float | None = None  # None: the engine's own --gpu-memory-utilization

    def argv(self) -> list[str]:
        extra = ["--device", self.device] if self.device else []
        if self.utilization is not None:
            extra += ["--gpu-memory-utilization", f"{self.utilization:.4g}"]
        return extra


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _normalized(device: str, flag: str, num_gpus: int) -> str:
    """cpu, or cuda:N with N a visible GPU; ValueError naming the flag otherwise."""
    name = device.strip()
    if name == "cpu":
        return name
    kind, _, index = name.partition(":")
    if kind != "cuda" or not (index == "" or index.isdigit()):
        raise ValueError(f"{flag} {device}: must be cpu, cuda or cuda:N")
    index = int(index or 0)
    if index >= num_gpus:
        raise ValueError(f"{flag} {device}: {num_gpus} GPU{'s' if num_gpus != 1 else ''} visible")
    return f"cuda:{index}"


def place_engines(roles: list[str], device: str | None, tier_devices: dict[str, str | None], num_gpus: int,
                  utilization: float | None = None) -> list[Placement]:
    """One Placement per engine, in start order (`roles`: each engine's tier)."""
    tiers = {role: [_normalized(d, f"--{role}-device", num_gpus) for d in listed.split(",")]
             for role, listed in tier_devices.items() if listed}  # every one checked, used or not
    taken = Counter()
    devices = []
    for n, role in enumerate(roles):
        if role in tiers:
            devices.append(tiers[role][taken[role] % len(tiers[role])])
            taken[role] += 1
        elif device and device != "auto":
            devices.append(_normalized(device, "--device", num_gpus))
        elif num_gpus:
            devices.append(f"cuda:{n % num_gpus}")
        else:
            devices.append(None)
    sharing = Counter(d for d in devices if d and d.startswith("cuda"))
    share = DEFAULT_UTILIZATION if utilization is None else utilization
    return [Placement(d, True, share / sharing[d]) if sharing.get(d, 0) > 1 else Placement(d) for d in devices]
