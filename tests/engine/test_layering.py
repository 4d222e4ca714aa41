"""Who may import whom, read from the source (every import, also those inside functions):
the tree says where code runs, and the packages depend in one direction.

    kv_transfer.base  <-  engine.common  <-  engine.front
                                         <-  engine.worker  <-  engine.core  <-  engine.offline
    kernels           <-  engine.worker
    kv_transfer.nixl_* (the NIXL implementation) <- engine.core (which plugs it)
    engine.front, engine.common  <-  services (servers, router, OpenAI front; never the core or model)
    services, engine.common, baton.testing  <-  services.cli (the command line)
    baton.testing imports nothing of baton

Every source module must have a rule here, and a line in docs/architecture.md's tables.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# A folder -> the baton modules (prefixes) its code may import.
ALLOWED = {
    "kv_transfer/base.py": (),
    "engine/__init__.py": (),
    "kv_transfer": ("baton.kv_transfer",),
    "kernels": ("baton.kernels",),
    "engine/common": ("baton.engine.common", "baton.kv_transfer.base"),
    "engine/front": ("baton.engine.common", "baton.engine.front", "baton.kv_transfer.base"),
    "engine/worker": ("baton.engine.common", "baton.engine.worker", "baton.kernels", "baton.kv_transfer.base"),
    "engine/core": ("baton.engine.common", "baton.engine.core", "baton.engine.worker", "baton.kv_transfer"),
    "engine/offline": ("baton.engine", "baton.kv_transfer.base"),
    # The router needs no engine: block hashing and tokenizer files from the contracts only.
    "services/router": ("baton.engine.common", "baton.kv_transfer.base", "baton.services", "baton.v1"),
    # The servers' fronts: the engine's front half and contracts, never its core or model.
    "services/server": ("baton.engine.common", "baton.engine.front", "baton.kv_transfer.base", "baton.services",
                        "baton.v1"),
    # The encoder tier (E/P/D) is an engine without a core: the front's image processing and the
    # model's image encoder in one process, its embeddings held for readers over NIXL.
    "services/encoder": ("baton.engine.common", "baton.engine.front", "baton.engine.worker", "baton.kv_transfer",
                         "baton.services", "baton.v1"),
    # A server's front reads an encoder tier's embeddings over NIXL (the reader's half only).
    "services/server/encoded_images.py": ("baton.engine.common", "baton.engine.front", "baton.kv_transfer.base",
                                          "baton.kv_transfer.nixl_embeddings", "baton.services", "baton.v1"),
    "services/openai": ("baton.engine.common", "baton.services", "baton.v1"),
    "services/rpc": ("baton.engine.common", "baton.kv_transfer.base", "baton.services", "baton.v1"),
    "services/telemetry": ("baton.engine.common", "baton.services", "baton.v1"),
    # The command line: the launcher and glue, over the services and the engine's contracts; the
    # offline engine through `baton`'s lazy LLM only; the tiny checkpoints prepare-models writes.
    "services/cli": ("baton", "baton.engine.common", "baton.kernels", "baton.services", "baton.testing"),
    # `baton models` reads a checkpoint as the engine does (its families' config readers, the loader's
    # and the quantized formats' reading of its files' headers), no weights.
    "services/cli/model_info.py": ("baton.engine.common", "baton.engine.worker.models", "baton.engine.worker.loader",
                                   "baton.engine.worker.quant.formats"),
    "services/client.py": ("baton.services.rpc", "baton.v1"),
    "services/__init__.py": (),
    "baton/testing": (),  # importable without the engine: tests and benchmarks write checkpoints with it
}
EXACT = ("baton",)  # allowed as the package itself, not everything under it


def baton_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n == "baton" or n.startswith("baton.")}


def rule_for(rel: str) -> tuple[str, tuple[str, ...]] | None:
    """The most specific rule covering a file (a path relative to the repository)."""
    matches = [key for key in ALLOWED if rel == key or rel.startswith(key + "/")]
    return (max(matches, key=len), ALLOWED[max(matches, key=len)]) if matches else None


PACKAGES = ("engine", "kv_transfer", "kernels", "services", "baton/testing")
FILES = sorted(str(p.relative_to(ROOT)) for folder in PACKAGES for p in (ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("rel", FILES)
def test_imports_follow_the_layers(rel):
    key, allowed = rule_for(rel) or (None, ())
    assert key is not None, f"{rel}: no rule in ALLOWED covers it (add one: who may it import?)"
    wrong = sorted(name for name in baton_imports(ROOT / rel)
                   if not any(name == a or (a not in EXACT and name.startswith(a + ".")) for a in allowed))
    assert not wrong, f"{rel} ({key} may import only {', '.join(allowed) or 'nothing of baton'}) imports {wrong}"


def test_every_engine_module_sits_in_a_process_folder():
    loose = sorted(p.name for p in (ROOT / "engine").glob("*.py") if p.name != "__init__.py")
    assert not loose, f"engine/ modules outside front/, core/, worker/, common/, offline/: {loose}"


def test_every_module_is_in_the_docs_tables():
    """docs/architecture.md's tables name every source module (by its name, or its path under
    the folder the row is about), so the map of the tree cannot lag it."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    tables = "\n".join(line for line in doc.splitlines() if line.startswith("|"))
    named = set(re.findall(r"`(?:[\w./]*/)?([\w]+\.py)`", tables))
    missing = sorted(rel for rel in FILES if Path(rel).name not in ("__init__.py", "__main__.py")
                     and Path(rel).name not in named)
    assert not missing, f"docs/architecture.md's tables name none of {missing}"
