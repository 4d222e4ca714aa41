"""Generate the Python code for proto/**/*.proto into the source tree (`./dev proto`).

The generated modules land beside the package they belong to (baton/v1/*_pb2*.py for
package baton.v1) and are committed; never edit them by hand. `--check` regenerates into a
temporary folder and fails when the committed files differ (the test suite runs it).
"""
from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
REPO = PROTO_ROOT.parent


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generated_names(proto: Path) -> list[Path]:
    stem = proto.relative_to(PROTO_ROOT).with_suffix("")
    return [stem.parent / f"{stem.name}{suffix}" for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc  # a test/dev dependency only
    include = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    rc = protoc.main(["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_dir}",
                      f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *files])
    if rc != 0:
        sys.exit(f"protoc failed with exit status {rc}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if the committed code is stale")
    args = parser.parse_args()
    if not args.check:
        generate(REPO)
        return
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = [str(name) for proto in proto_files() for name in generated_names(proto)
                 if not (REPO / name).is_file() or not filecmp.cmp(Path(tmp) / name, REPO / name, shallow=False)]
    if stale:
        sys.exit(f"generated code is stale or missing: {', '.join(stale)}; run ./dev proto")
    print("generated code is up to date")


if __name__ == "__main__":
    main()
