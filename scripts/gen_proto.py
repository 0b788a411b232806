"""Generate noloco_node/wire/v1 from proto/ with grpcio-tools; the only way to regenerate it.

Usage:
    python scripts/gen_proto.py           # write the generated modules into noloco_node/wire/v1
    python scripts/gen_proto.py --check   # regenerate into a temp dir; exit 1 if anything differs

The proto folder path equals the Python import path (proto/noloco_node/wire/v1/*.proto), so the
generated imports read `from noloco_node.wire.v1 import tensor_pb2` with no rewriting.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PACKAGE_DIR = Path("noloco_node") / "wire" / "v1"


def generate(out_root: Path) -> list[Path]:
    """Run protoc on every .proto under proto/ and return the generated files (relative)."""
    import grpc_tools
    from grpc_tools import protoc

    sources = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))
    if not sources:
        raise SystemExit(f"no .proto files under {PROTO_ROOT / PACKAGE_DIR}")
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted(p.relative_to(out_root) for p in (out_root / PACKAGE_DIR).glob("*_pb2*.py*"))


def check() -> list[str]:
    """Return the generated files that differ from (or are missing in) the checked-in tree."""
    with tempfile.TemporaryDirectory() as tmp:
        generated = generate(Path(tmp))
        drift = [
            str(rel)
            for rel in generated
            if not (ROOT / rel).exists() or not filecmp.cmp(Path(tmp) / rel, ROOT / rel, shallow=False)
        ]
        stale = {p.relative_to(ROOT) for p in (ROOT / PACKAGE_DIR).glob("*_pb2*.py*")} - set(generated)
        return drift + [f"{p} (no .proto source)" for p in sorted(stale)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the checked-in code is stale")
    args = parser.parse_args()
    if args.check:
        drift = check()
        for path in drift:
            print(f"stale generated file: {path}", file=sys.stderr)
        if drift:
            print("run: python scripts/gen_proto.py", file=sys.stderr)
        return 1 if drift else 0
    for rel in generate(ROOT):
        print(f"wrote {rel}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
