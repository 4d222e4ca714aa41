"""Who may import whom, read from the source (every import, also those inside functions):
the tree says where code runs, and the packages depend in one direction.

    kv_transfer.base  <-  engine.common  <-  engine.front
                                         <-  engine.worker  <-  engine.core  <-  engine.offline
    kernels           <-  engine.worker
    kv_transfer.nixl_* (the NIXL implementation) <- engine.core (which plugs it)
    engine.front, engine.common  <-  services (servers, router, OpenAI front; never the core or model)
"""
from __future__ import annotations

import ast
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
    "services/openai": ("baton.engine.common", "baton.services", "baton.v1"),
    "services/rpc": ("baton.engine.common", "baton.kv_transfer.base", "baton.services", "baton.v1"),
    "services/telemetry": ("baton.engine.common", "baton.services", "baton.v1"),
}


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


FILES = sorted(str(p.relative_to(ROOT)) for folder in ("engine", "kv_transfer", "kernels", "services/router",
                                                          "services/server", "services/openai", "services/rpc",
                                                          "services/telemetry")
               for p in (ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("rel", FILES)
def test_imports_follow_the_layers(rel):
    key, allowed = rule_for(rel)
    wrong = sorted(name for name in baton_imports(ROOT / rel)
                   if not any(name == a or name.startswith(a + ".") for a in allowed))
    assert not wrong, f"{rel} ({key} may import only {', '.join(allowed) or 'nothing of baton'}) imports {wrong}"


def test_every_engine_module_sits_in_a_process_folder():
    loose = sorted(p.name for p in (ROOT / "engine").glob("*.py") if p.name != "__init__.py")
    assert not loose, f"engine/ modules outside front/, core/, worker/, common/, offline/: {loose}"
