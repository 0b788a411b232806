"""The package's structure (scripts/structure.py, read from the source with ast): no import against
the layering, at most two loose top-level modules, no module over 400 lines, no function over 60
lines, no constructor over 8 parameters, and no hook assigned onto another object after it was
built. Each check is also run on a small sample that breaks it, so a checker that stopped finding
anything would fail here."""

import ast
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("structure", ROOT / "scripts" / "structure.py")
structure = sys.modules.setdefault("structure", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(structure)


def test_the_package_keeps_its_structure():
    report = structure.measure()
    assert report.layering == []
    assert len(report.loose_modules) <= structure.MAX_LOOSE_MODULES, report.loose_modules
    assert report.long_modules == []
    assert report.long_functions == []
    assert report.wide_constructors == []
    assert report.late_hooks == []
    assert report.modules > 100  # it really read the package


def _hooks(source: str) -> list[str]:
    report = structure.Report()
    structure._check_hooks(report, "sample.py", ast.parse(source))
    return report.late_hooks


def test_late_hooks_are_found_in_every_shape_they_took():
    assert _hooks("class Node:\n    def start(self):\n        self.runtime.on_inner_step = self._on_inner_step\n")
    assert _hooks("class Node:\n    def start(self):\n        self.worker.stash_weights = True\n")
    assert _hooks("class Driver:\n    def __init__(self, runtime):\n        runtime.before_backward = self.gate\n")
    assert _hooks("def wire(x):\n    def cb(): pass\n    x.callback = cb\n")
    assert _hooks("def wire(x):\n    x.handler = lambda: 1\n")
    # what is not a hook: our own attributes, records we fill in, parts we build in our constructor
    assert not _hooks(
        "class A:\n    def __init__(self, n):\n        self.n = n\n        self.model = M()\n"
        "        self.model.layers = L()\n"
    )
    assert not _hooks("def f(ticket, peer):\n    ticket.downstream = peer.peer_id\n")


def test_imports_against_the_layering_are_found():
    assert not structure._allowed("pipeline", "rpc.stage_service")
    assert not structure._allowed("sync", "rpc.outer_service")
    assert not structure._allowed("sync", "wire.v1.outer_pb2")
    assert not structure._allowed("transport", "model.stage")
    assert not structure._allowed("optim", "pipeline.worker")
    assert not structure._allowed("sync", "pipeline.runtime") and structure._allowed("sync", "pipeline.worker")
    assert not structure._allowed("dashboard", "node.lifecycle") and structure._allowed("dashboard", "node.attention")
    assert not structure._allowed("node", "wire.v1.stage_pb2")
    assert structure._allowed("rpc", "pipeline.ports") and not structure._allowed("rpc", "pipeline.runtime")
    assert (
        structure._allowed("sync", "codec.tensors")
        and not structure._allowed("sync", "wire.v1.outer_pb2")
        and structure._allowed("node", "rpc.server")
    )


def _function_of(lines: int) -> ast.Module:
    """A function `lines` long, its `def` line included."""
    body = "\n".join(f"    x{i} = {i}" for i in range(lines - 1))
    return ast.parse(f"def f():\n{body}\n")


def test_long_functions_and_wide_constructors_are_found():
    report = structure.Report()
    structure._check_functions(report, "sample.py", _function_of(structure.MAX_FUNCTION_LINES + 1))
    structure._check_functions(
        report, "sample.py", ast.parse("class A:\n    def __init__(self, a, b, c, d, e, f, g, h, i, j, *, k): pass\n")
    )
    assert len(report.long_functions) == 1 and len(report.wide_constructors) == 1
    assert report.long_functions == [f"sample.py:1 f ({structure.MAX_FUNCTION_LINES + 1} lines)"]


def test_the_limits_are_the_house_style():
    assert (structure.MAX_MODULE_LINES, structure.MAX_FUNCTION_LINES, structure.MAX_INIT_PARAMS) == (400, 60, 8)
    report = structure.Report()
    structure._check_functions(report, "sample.py", _function_of(structure.MAX_FUNCTION_LINES))
    assert report.long_functions == []  # at the limit is within it
    at_limit = "class A:\n    def __init__(self, a, b, c, d, e, f, g, *, h): pass\n"  # 8 parameters
    structure._check_functions(report, "sample.py", ast.parse(at_limit))
    assert report.wide_constructors == []
    structure._check_functions(report, "sample.py", ast.parse(at_limit.replace("*, h", "*, h, i")))
    assert report.wide_constructors == ["sample.py:2 __init__ (9 parameters)"]


def test_long_modules_are_found_and_one_at_the_limit_is_not():
    report = structure.Report()
    structure._check_module_length(report, "at_limit.py", "x = 1\n" * structure.MAX_MODULE_LINES)
    assert report.long_modules == []
    structure._check_module_length(report, "over.py", "x = 1\n" * (structure.MAX_MODULE_LINES + 1))
    assert report.long_modules == [f"over.py ({structure.MAX_MODULE_LINES + 1} lines)"]
