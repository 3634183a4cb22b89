"""Generate the Python gRPC stubs from protos/ into tandem/v1/ (checked in; CI checks they are current)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"


def generate(out_dir: Path = ROOT) -> None:
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in (PROTO_DIR / "tandem" / "v1").glob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
