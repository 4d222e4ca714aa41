"""No code finds its collaborators by name: a hook is declared on a base class, a part is an
attribute that may be None, a kind is a type or an enum. `getattr`/`hasattr`/`setattr` remain
only where the name is the data: a protobuf oneof or field list, a config's fields read or
checked in one loop, a third-party object whose attribute differs by version. Each such place
is listed here with why; a new one fails until it is listed (or removed), and a listed one that
is gone fails too, so the list stays exact."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "services", "kv_transfer", "kernels")
NAME_BUILTINS = {"getattr", "hasattr", "setattr", "delattr"}

# (module, enclosing function) -> why the name is data there.
_CONFIG = "a config's fields checked or read in one loop, the field's name in the error"
_PROTO = "a protobuf oneof or message named by its descriptor"
ALLOWED = {
    ("engine/common/config.py", "EngineConfig.__post_init__"): _CONFIG,
    ("engine/common/config.py", "EngineConfig._check_graphs"): _CONFIG,
    ("engine/common/config.py", "EngineConfig._check_lora"): _CONFIG,
    ("engine/common/config.py", "EngineConfig.torch_dtype"): "a dtype's name in config.json as torch's dtype",
    ("engine/common/sampling_params.py", "SamplingParams.__post_init__"): _CONFIG,
    ("engine/common/speculative.py", "SpeculativeConfig.__post_init__"): _CONFIG,
    ("engine/front/detokenizer.py", "IncrementalDetokenizer.__init__"):
        "transformers' tokenizers: a slow one has no backend_tokenizer, old ones no clean_up flag",
    ("engine/worker/quant/placement.py", "QuantizedPlacement.install"):
        "a float layer replaced by its quantized form at the module path the checkpoint names",
    ("engine/worker/lora/layers.py", "LoRASlots.attach"): "PEFT's target modules are names: the layer's parts by them",
    ("kv_transfer/base.py", "KVFormat.check_peer"): _CONFIG + " (both sides' KV formats, compared)",
    ("services/cli/demo_models.py", "prepare_smollm2"): "a transformers config with or without quantization_config",
    ("services/client.py", "chunk_from_response"): _PROTO,
    ("services/openai/front.py", "OpenAIFront._complete"): "a protobuf field set where its range is checked",
    ("services/openai/protocol.py", "sampling_from_body"): "the JSON field's protobuf field, from a table",
    ("services/openai/protocol.py", "_structured_output"): "the JSON field's protobuf field (regex, grammar)",
    ("services/openai/protocol.py", "Completion._account"): _PROTO,
    ("services/router/router.py", "RouterOptions.__post_init__"): _CONFIG,
    ("services/rpc/serving.py", "add_text_generation"): _PROTO,
    ("services/rpc/tls.py", "TLSConfig.__post_init__"): _CONFIG,
    ("services/rpc/tls.py", "TLSConfig._read"): "one of the config's three file paths",
    ("services/server/core_requests.py", "sampling_params_from_proto"): _PROTO + " (the fields that were set)",
    ("services/telemetry/trace_view.py", "_value"): _PROTO + " (OTLP's AnyValue)",
    ("services/telemetry/tracing.py", "start_span"):
        "OpenTelemetry's SpanKind by name: callers need not import OpenTelemetry, an optional dependency",
    ("services/telemetry/tracing.py", "genai_request_attributes"): _PROTO + " (the SamplingParams fields set)",
}


def _name_lookups(node: ast.AST, scope: str = ""):
    """(enclosing function, line) of each getattr/hasattr/setattr/delattr call under `node`."""
    for child in ast.iter_child_nodes(node):
        inner = scope
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            inner = f"{scope}.{child.name}" if scope else child.name
        if isinstance(child, ast.Call) and isinstance(child.func, ast.Name) and child.func.id in NAME_BUILTINS:
            yield scope or "<module>", child.lineno
        yield from _name_lookups(child, inner)


def _sites() -> dict[tuple[str, str], list[int]]:
    sites: dict[tuple[str, str], list[int]] = {}
    for path in sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py")):
        module = str(path.relative_to(ROOT))
        for scope, line in _name_lookups(ast.parse(path.read_text(), str(path))):
            sites.setdefault((module, scope), []).append(line)
    return sites


def test_names_are_looked_up_only_where_the_name_is_data():
    sites = _sites()
    unlisted = [f"{module}:{lines[0]} in {scope}" for (module, scope), lines in sites.items()
                if (module, scope) not in ALLOWED]
    assert not unlisted, ("getattr/hasattr/setattr on a name: declare the hook or part, or list the place in "
                          f"ALLOWED with why: {unlisted}")
    gone = [key for key in ALLOWED if key not in sites]
    assert not gone, f"listed in ALLOWED but no longer there (remove them): {gone}"
