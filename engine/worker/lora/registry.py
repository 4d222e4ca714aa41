"""The adapters an engine serves, by name: loaded at start (`lora_modules`) or at run time,
each given an id (never reused, so a reloaded name is a new adapter) and the root of its
requests' block-hash chains. Host copies of their weights are kept for the `max_cpu_loras`
most recently used; the others are read again from disk when needed."""
from __future__ import annotations

import itertools
from collections import OrderedDict

import torch

from baton.engine.common.config import EngineConfig
from baton.engine.common.core_messages import AdapterInfo
from baton.engine.common.errors import InUse, InvalidArgument, NotFound, check
from baton.engine.worker.lora.adapter import LoRAWeights, adapter_fingerprint, load_adapter
from baton.engine.worker.lora.layers import LoRASlots
from baton.engine.worker.models import ModelArgs


class LoRARegistry:
    def __init__(self, args: ModelArgs, max_loras: int, max_lora_rank: int, max_cpu_loras: int):
        self.args = args
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.adapters: dict[str, AdapterInfo] = {}
        self.by_id: dict[int, AdapterInfo] = {}
        self.host: OrderedDict[int, LoRAWeights] = OrderedDict()  # LRU first
        self._ids = itertools.count(1)  # 0 is the base model
        self.num_disk_reads = 0

    def load(self, name: str, path: str) -> AdapterInfo:
        """Read, check and register an adapter; raises InvalidArgument naming the field."""
        check(isinstance(name, str) and name != "" and name.strip() == name, "lora_name",
              f"must be a non-empty name without surrounding spaces, got {name!r}")
        check(name not in self.adapters, "lora_name", f"an adapter named {name!r} is loaded already")
        _, weights = load_adapter(path, self.args, self.max_lora_rank)
        info = AdapterInfo(name, path, weights.rank, next(self._ids), adapter_fingerprint(path))
        self.adapters[name], self.by_id[info.adapter_id] = info, info
        self._keep(info.adapter_id, weights)
        return info

    def unload(self, name: str, num_requests: int) -> AdapterInfo:
        """Forget an adapter no request uses; raises NotFound or InUse naming lora_name."""
        info = self.get(name, "lora_name")
        if num_requests:
            raise InUse("lora_name", f"adapter {name!r} has {num_requests} request(s) in flight; "
                                     f"unload it once they end")
        del self.adapters[name], self.by_id[info.adapter_id]
        self.host.pop(info.adapter_id, None)
        return info

    def get(self, name: str, field: str) -> AdapterInfo:
        info = self.adapters.get(name)
        if info is None:
            loaded = ", ".join(sorted(self.adapters)) or "none"
            raise NotFound(field, f"no LoRA adapter named {name!r} is loaded (loaded: {loaded})")
        return info

    def host_weights(self, adapter_id: int) -> LoRAWeights:
        weights = self.host.get(adapter_id)
        if weights is None:
            info = self.by_id[adapter_id]
            try:
                _, weights = load_adapter(info.path, self.args, self.max_lora_rank)
            except InvalidArgument as e:  # changed on disk since it was loaded
                raise RuntimeError(f"adapter {info.name!r} could not be read again from {info.path}: {e}") from None
            self.num_disk_reads += 1
            self._keep(adapter_id, weights)
        else:
            self.host.move_to_end(adapter_id)
        return weights

    def _keep(self, adapter_id: int, weights: LoRAWeights) -> None:
        self.host[adapter_id] = weights
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)


def start_lora(config: EngineConfig, args: ModelArgs, model, dtype) -> tuple[LoRARegistry | None, LoRASlots | None]:
    """With LoRA on: the adapter registry (lora_modules loaded, in their order: every
    tensor-parallel rank gives them the same ids) and the device slots, the model's projections
    (split already, under tensor parallelism) wrapped to add the step's adapters' deltas."""
    if not config.enable_lora:
        return None, None
    check(args.attention != "mla", "enable_lora", f"LoRA adapters on {args.architecture}'s multi-head latent "
                                                  f"attention are not supported")
    registry = LoRARegistry(args, config.max_loras, config.max_lora_rank, config.max_cpu_loras or config.max_loras)
    for name, path in config.lora_modules.items():
        try:
            registry.load(name, path)
        except InvalidArgument as e:
            raise InvalidArgument(f"lora_modules.{name}.{e.field}", e.reason) from None
    slots = LoRASlots(config.max_loras, registry.host_weights, torch.device(config.device), dtype)
    slots.attach(model)
    return registry, slots
