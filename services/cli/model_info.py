"""`baton models`: the architectures Baton serves, and what it reads of a checkpoint (or why it
refuses it, naming the field) without loading any weight."""
from __future__ import annotations

import sys


def describe(model_dir: str, max_model_len: int | None) -> list[str]:
    """Lines on what Baton makes of `model_dir`'s config.json; InvalidArgument where it refuses it."""
    from baton.engine.common.config import read_config
    from baton.engine.common.errors import check
    from baton.engine.common.kv_groups import group_layers
    from baton.engine.worker.loader import checkpoint_bytes, checkpoint_fingerprint
    from baton.engine.worker.models import model_args
    from baton.engine.worker.quant.formats import checkpoint_format

    config = read_config(model_dir)
    a, fmt = model_args(config), checkpoint_format(config)
    max_len = max_model_len or min(a.max_position_embeddings, 8192)
    check(max_len <= a.max_position_embeddings, "max_model_len",
          f"{max_len} exceeds the model's max_position_embeddings {a.max_position_embeddings}")
    rope = (a.rope_scaling or {}).get("rope_type", (a.rope_scaling or {}).get("type", "default"))
    windows = a.layer_windows(max_len)
    groups = group_layers(windows)
    sliding = sum(w is not None for w in windows)
    partial = f", {a.rotary_dim} of {a.head_dim} dims" if a.rotary_dim not in (0, a.head_dim) else ""
    kv_per_token = sum(len(layers) for layers, w in zip(groups.layers, groups.windows) if w is None)
    return [f"{model_dir}: {a.architecture}",
            f"  {a.num_layers} layers, hidden {a.hidden_size}, {a.num_heads} query / {a.num_kv_heads} KV heads of "
            f"{a.head_dim}, vocabulary {a.vocab_size}, {'tied' if a.tie_word_embeddings else 'untied'} head",
            f"  RoPE {rope} (theta {a.rope_theta:g}{partial})"
            f", context up to {a.max_position_embeddings}",
            f"  at max_model_len {max_len}: {sliding} sliding-window layers"
            + (f" (window {max(w for w in windows if w)})" if sliding else "")
            + f", {len(groups.windows)} KV cache group(s) of {groups.layers_per_block} layer(s); "
              f"{kv_per_token} of {a.num_layers} layers keep every token's KV",
            _weights_line(checkpoint_bytes(model_dir), fmt),
            f"  fingerprint {checkpoint_fingerprint(model_dir)} (what a P/D peer's --accept-kv-from may name)"]


def _weights_line(sizes: dict[str, int], fmt) -> str:
    """The checkpoint's weights: their format and the memory they take as Baton holds them (a
    quantized checkpoint's layers stay as stored; a float one's in the dtype it is served in,
    given by --dtype, here as stored)."""
    kinds = ", ".join(f"{dtype} {_size(n)}" for dtype, n in sorted(sizes.items(), key=lambda kv: -kv[1]))
    what = (f"quantized ({fmt.describe()}), kept as stored: {_size(sum(sizes.values()))} in memory"
            if fmt is not None else f"unquantized, {_size(sum(sizes.values()))} as stored (in memory: at --dtype)")
    return f"  weights: {what} ({kinds})"


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def models(args) -> None:
    from baton.engine.common.errors import InvalidArgument
    from baton.engine.worker.models import FAMILIES
    from baton.engine.worker.models.rope import KINDS

    if not args.model_dirs:
        print("architectures:", ", ".join(FAMILIES))
        print("rope scalings:", ", ".join(KINDS))
        return
    failed = False
    for model_dir in args.model_dirs:
        try:
            print("\n".join(describe(model_dir, args.max_model_len)))
        except InvalidArgument as e:
            print(f"{model_dir}: refused: {e.field}: {e.reason}", file=sys.stderr)
            failed = True
        except KeyError as e:  # a field the family reads is not in config.json
            print(f"{model_dir}: refused: {e.args[0]}: config.json lacks it", file=sys.stderr)
            failed = True
    if failed:
        sys.exit(1)
