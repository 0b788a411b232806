"""Generated wire code matches the .proto sources and imports alongside hivemind."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_generated_code_matches_proto_sources():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_wire_imports_together_with_hivemind():
    code = (
        "import hivemind\n"
        "from hivemind.proto import dht_pb2\n"
        "from noloco_node.wire.v1 import tensor_pb2, stage_pb2, outer_pb2, stage_pb2_grpc, outer_pb2_grpc\n"
        "from grpc_health.v1 import health_pb2\n"
        "h = stage_pb2.ForwardHeader(labels=[1, 2, 3], activations=tensor_pb2.TensorHeader(shape=[1, 3, 8]))\n"
        "m = stage_pb2.ForwardMessage(header=h)\n"
        "assert stage_pb2.ForwardMessage.FromString(m.SerializeToString()).header.labels == [1, 2, 3]\n"
        "assert dht_pb2.PingRequest is not None and health_pb2.HealthCheckRequest is not None\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_outer_math_imports_no_networking_or_transformers():
    code = (
        "import sys\n"
        "import noloco_node.optim.outer, noloco_node.optim.state, noloco_node.optim.inner\n"
        "bad = [m for m in ('grpc', 'hivemind', 'transformers', 'datasets') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"optim imported {result.stdout.strip()}"


def test_pure_layers_do_not_import_networking():
    # torch imports asyncio itself, so this is checked on the source: optim/ and model/ never
    # import grpc, hivemind or asyncio, and codec/tensors.py stays torch-only too.
    import ast

    forbidden = {"grpc", "hivemind", "asyncio"}
    files = [
        *(ROOT / "noloco_node" / "optim").glob("*.py"),
        *(ROOT / "noloco_node" / "model").glob("*.py"),
        ROOT / "noloco_node" / "codec" / "tensors.py",
    ]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                assert name.split(".")[0] not in forbidden, f"{path.name} imports {name}"
