"""The Triton kernels compile a bounded number of variants over a long serving trace. Triton
compiles a kernel again for each new key of: its constexprs, each integer argument's value
class (equal to 1, divisible by 16) unless marked do_not_specialize, and each pointer's
16-byte alignment. Every compile stalls every running request, so variants must all appear
in the first steps, not hundreds of steps in. The rule is applied here to the arguments the
real wrappers pass for batches the real runner builds; no kernel runs."""
from __future__ import annotations

import inspect
import os
import random
import types

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
pytest.importorskip("triton")
from baton.engine.worker.batch_builder import BatchBuilder
from baton.engine.worker.block_tables import Staging
from baton.kernels import triton_attention

KERNELS = ("_decode_split", "combine_splits", "_write_kv", "_prefill")


class Specializations:
    """Stands in for a kernel: records the key Triton would compile each launch under."""

    def __init__(self, kernel):
        fn = getattr(kernel, "fn", kernel)  # the interpreter's wrapper, or the JITFunction
        while not inspect.isfunction(fn):
            fn = fn.fn
        options = getattr(kernel, "kwargs", None) or {}
        self.unspecialized = set(options.get("do_not_specialize") or getattr(kernel, "do_not_specialize", ()) or ())
        self.params = list(inspect.signature(fn).parameters.values())
        self.keys: dict[tuple, int] = {}  # key -> the step it first appeared at
        self.step = 0

    def _key_of(self, param, value):
        if "constexpr" in str(param.annotation):
            return value
        if isinstance(value, torch.Tensor):
            return str(value.dtype), value.data_ptr() % 16 == 0
        if isinstance(value, bool):
            return "i1"
        if isinstance(value, int):
            if param.name in self.unspecialized:
                return "int"
            return "int", value == 1, value % 16 == 0
        return type(value).__name__

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            bound = dict(zip((p.name for p in self.params), args))
            key = tuple(self._key_of(p, bound[p.name] if p.name in bound else kwargs[p.name]) for p in self.params)
            key += tuple(sorted((k, v) for k, v in kwargs.items() if k in ("num_warps", "num_stages")))
            self.keys.setdefault(key, self.step)
        return launch


def serving_trace(steps: int, block_size: int, seed: int = 0):
    """Mixed batches as a scheduler emits them: decodes of growing contexts (1-64 at once),
    with prefill chunks of new prompts arriving now and then."""
    rng = random.Random(seed)
    running: list[list[int]] = []  # [context length, first block id]
    next_block = 0
    for _ in range(steps):
        while len(running) < rng.randint(1, 64):
            running.append([rng.randint(1, 3000), next_block])
            next_block += 1000
        decodes = [(n - 1, n, np.arange(first, first + -(-n // block_size), dtype=np.int32)) for n, first in running]
        prefills = []
        for _ in range(rng.choice((0, 0, 0, 1, 2))):
            start, length = rng.randint(0, 2000), rng.randint(1, 512)
            prefills.append((start, start + length,
                             np.arange(next_block, next_block + -(-(start + length) // block_size), dtype=np.int32)))
            next_block += 1000
        yield decodes, prefills
        for r in running:
            r[0] += 1
        if rng.random() < 0.2:
            running.pop(rng.randrange(len(running)))


@pytest.mark.parametrize("block_size,group,head_dim", [(16, 4, 128), (16, 7, 64), (128, 8, 128)])
def test_a_3000_step_trace_compiles_few_variants_and_all_early(monkeypatch, block_size, group, head_dim):
    recorders = {name: Specializations(getattr(triton_attention, name)) for name in KERNELS}
    for name, recorder in recorders.items():
        monkeypatch.setattr(triton_attention, name, recorder)
    cpu = torch.device("cpu")
    runner = types.SimpleNamespace(block_size=block_size, device=cpu, staging=Staging(cpu))
    num_kv_heads = 2
    k_cache = torch.empty(4, block_size, num_kv_heads, head_dim)
    for step, (decodes, prefills) in enumerate(serving_trace(3000, block_size)):
        for recorder in recorders.values():
            recorder.step = step
        (meta,) = BatchBuilder._triton_batches(runner, [decodes + prefills], len(decodes))  # one KV cache group
        num_tokens = len(decodes) + sum(end - start for start, end, _ in prefills)
        q = torch.empty(num_tokens, num_kv_heads * group, head_dim)
        kv = torch.empty(num_tokens, num_kv_heads, head_dim)
        triton_attention.paged_attention(q, kv, kv, k_cache, k_cache, meta.triton, 0.125)
    variants = {name: sorted(r.keys.values()) for name, r in recorders.items()}
    # decode: one split or several; combine: one; write: one; prefill: one.
    assert sum(len(v) for v in variants.values()) <= 6, variants
    assert max(s for v in variants.values() for s in v) < 50, variants  # none appears late
