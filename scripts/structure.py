"""The package's structure, measured from its source (ast, nothing imported):

- imports that break the layering (`ALLOWED`: what each first-level package may import),
- loose top-level modules (besides `__init__`/`__main__`),
- modules over MAX_MODULE_LINES lines, functions over MAX_FUNCTION_LINES lines, constructors over
  MAX_INIT_PARAMS parameters (the house style's limits; the code as `ruff format` lays it out),
- hooks assigned onto another object after it was built (`obj.on_x = ...`, `obj.attr = self.method`,
  `obj.attr = lambda ...`, or a function defined in scope): every hook is a constructor argument.

    python scripts/structure.py        # prints the figures; exit 1 when a rule is broken

tests/unit/test_structure.py runs the same checks.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "noloco_node"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
MAX_INIT_PARAMS = 8
MAX_LOOSE_MODULES = 2

_BASE = {"errors", "codec", "config", "runtime"}
_PURE = _BASE | {"model", "data", "optim"}
# What each first-level package may import. A "pkg.module" entry allows that module only: the
# ports are the vocabulary rpc/ shares with the pipeline and the sync layer, not their logic.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "codec": {"errors"},
    "wire": {"errors"},
    "config": {"errors", "runtime", "codec"},
    "runtime": {"errors", "config"},
    "model": _BASE,
    "data": _BASE,
    "optim": {"errors", "codec"},
    "transport": {"errors", "runtime"},
    "netem": {"errors", "runtime"},
    "dht": {"errors", "runtime", "config", "transport"},
    "pipeline": _PURE,
    # The outer step reads the stage's worker (its optimizer and gradients) and the pipeline's ports
    # and router's pick; the rest of pipeline/ (runtime, driver, transports) is not its business.
    "sync": _PURE | {"pipeline.worker", "pipeline.ports", "pipeline.router"},
    "rpc": _PURE | {"wire", "transport", "pipeline.ports", "sync.ports"},
    # The pages read records and stats as plain data; attention's rules are the node's, and pure.
    "dashboard": _BASE | {"node.attention"},
    "node": _PURE | {"transport", "netem", "dht", "pipeline", "sync", "rpc", "dashboard"},
    "experiments": _PURE | {"transport", "netem", "dht", "pipeline", "sync", "rpc", "node"},
    "cli": _PURE | {"transport", "netem", "dht", "pipeline", "sync", "rpc", "node", "experiments", "dashboard"},
}
ALLOWED["__main__"] = {"cli"}
# protobuf messages are rpc's (and the transports') business; the codec below them is pure torch.
WIRE_V1_USERS = {"rpc", "transport", "dht", "cli"}
HOOK_NAME = re.compile(r"^(on_|before_|after_)|(_hook|_fn|_callback|_cb)$")


@dataclass
class Report:
    layering: list[str] = field(default_factory=list)
    loose_modules: list[str] = field(default_factory=list)
    long_modules: list[str] = field(default_factory=list)
    long_functions: list[str] = field(default_factory=list)
    wide_constructors: list[str] = field(default_factory=list)
    late_hooks: list[str] = field(default_factory=list)
    modules: int = 0
    functions: int = 0
    longest_module: tuple[int, str] = (0, "")
    longest_function: tuple[int, str] = (0, "")
    widest_constructor: tuple[int, str] = (0, "")

    @property
    def broken(self) -> bool:
        return bool(
            self.layering
            or self.long_modules
            or self.long_functions
            or self.wide_constructors
            or self.late_hooks
            or len(self.loose_modules) > MAX_LOOSE_MODULES
        )


def _modules() -> list[tuple[Path, tuple[str, ...]]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[:2] == ("wire", "v1"):
            continue  # generated protobuf code
        out.append((path, parts))
    return out


def _imported(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("noloco_node"):
            tail = node.module.split(".")[1:]
            if not tail:  # from noloco_node import x
                found += [(node.lineno, a.name) for a in node.names]
            else:
                found.append((node.lineno, ".".join(tail)))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".", 1)[1]) for a in node.names if a.name.startswith("noloco_node.")]
    return found


def _allowed(source: str, target: str) -> bool:
    top = target.split(".")[0]
    if top == source or top == "__version__":
        return True
    if top == "wire" and target.startswith("wire.v1") and source not in WIRE_V1_USERS:
        return False
    allowed = ALLOWED.get(source, set())
    return top in allowed or any(target == a or target.startswith(a + ".") for a in allowed if "." in a)


def _check_layering(report: Report, parts: tuple[str, ...], tree: ast.AST) -> None:
    source = parts[0] if len(parts) > 1 else parts[0]
    for line, target in _imported(tree):
        if not _allowed(source, target):
            report.layering.append(f"{'/'.join(parts)}.py:{line} imports {target}")


def _check_module_length(report: Report, name: str, source: str) -> None:
    lines = source.count("\n")
    report.longest_module = max(report.longest_module, (lines, name))
    if lines > MAX_MODULE_LINES:
        report.long_modules.append(f"{name} ({lines} lines)")


def _check_functions(report: Report, name: str, tree: ast.AST) -> None:
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        report.functions += 1
        lines = node.end_lineno - node.lineno + 1
        where = f"{name}:{node.lineno} {node.name}"
        report.longest_function = max(report.longest_function, (lines, where))
        if lines > MAX_FUNCTION_LINES:
            report.long_functions.append(f"{where} ({lines} lines)")
        if node.name == "__init__":
            params = len(node.args.args) - 1 + len(node.args.kwonlyargs) + len(node.args.posonlyargs)
            report.widest_constructor = max(report.widest_constructor, (params, where))
            if params > MAX_INIT_PARAMS:
                report.wide_constructors.append(f"{where} ({params} parameters)")


def _functions_and_methods(tree: ast.Module) -> tuple[set[str], set[str]]:
    """Names of plain functions (module level, or nested in a function) and of methods."""
    functions, methods = set(), set()
    defs = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        names = {n.name for n in body if isinstance(n, defs)}
        (methods if isinstance(node, ast.ClassDef) else functions).update(names)
    return functions, methods


def _is_hook_value(value: ast.AST, functions: set[str], methods: set[str]) -> bool:
    if isinstance(value, ast.Lambda):
        return True
    if isinstance(value, ast.Name) and value.id in functions:
        return True
    if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) and value.value.id == "self":
        return value.attr in methods  # a bound method of ours handed to another object
    if isinstance(value, ast.Call) and isinstance(value.func, (ast.Name, ast.Attribute)):
        return getattr(value.func, "id", getattr(value.func, "attr", "")) == "partial"
    return False


def _wired_in_constructor(tree: ast.AST) -> set[int]:
    """Lines of a constructor that set an attribute on one of its parameters: wiring another
    object's behaviour after it was built."""
    lines = set()
    for init in ast.walk(tree):
        if not (isinstance(init, ast.FunctionDef) and init.name == "__init__"):
            continue
        params = {a.arg for a in init.args.args + init.args.kwonlyargs} - {"self"}
        for node in ast.walk(init):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            for t in targets:
                if not isinstance(t, ast.Attribute):
                    continue
                owner = t.value
                if isinstance(owner, ast.Name) and owner.id in params:
                    lines.add(node.lineno)
    return lines


def _set_on_held_parts(tree: ast.AST) -> set[int]:
    """Lines that set `self.part.attr` on a part this object holds (outside the constructor that
    created the part): reaching into a collaborator instead of asking it."""
    lines = set()
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        created = set()
        if func.name == "__init__":  # building our own parts (nn.Module submodules) is construction
            created = {
                t.attr
                for n in ast.walk(func)
                if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                for t in n.targets
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
            }
        for node in ast.walk(func):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            for t in targets:
                owner = getattr(t, "value", None)
                if (
                    isinstance(t, ast.Attribute)
                    and isinstance(owner, ast.Attribute)
                    and isinstance(owner.value, ast.Name)
                    and owner.value.id == "self"
                    and owner.attr not in created
                ):
                    lines.add(node.lineno)
    return lines


def _check_hooks(report: Report, name: str, tree: ast.AST) -> None:
    functions, methods = _functions_and_methods(tree)
    wired = _wired_in_constructor(tree) | _set_on_held_parts(tree)
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Assign, ast.AnnAssign)):
            continue
        if node.lineno in wired:
            report.late_hooks.append(f"{name}:{node.lineno} {ast.unparse(node)[:80]} (set on a collaborator)")
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            chain = [target] + (list(target.elts) if isinstance(target, ast.Tuple) else [])
            for t in chain:
                if not isinstance(t, ast.Attribute):
                    continue
                owner = t.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                    continue
                if HOOK_NAME.search(t.attr) or (
                    node.value is not None and _is_hook_value(node.value, functions, methods)
                ):
                    report.late_hooks.append(f"{name}:{node.lineno} {ast.unparse(t)} = {ast.unparse(node.value)[:60]}")


def measure() -> Report:
    report = Report()
    for path, parts in _modules():
        tree = ast.parse(path.read_text())
        name = "/".join(parts) + ".py"
        report.modules += 1
        if len(parts) == 1 and parts[0] not in ("__init__", "__main__"):
            report.loose_modules.append(parts[0])
        _check_layering(report, parts, tree)
        _check_module_length(report, name, path.read_text())
        _check_functions(report, name, tree)
        _check_hooks(report, name, tree)
    return report


def main() -> int:
    r = measure()
    print(f"modules: {r.modules} (generated protobuf excluded), functions: {r.functions}")
    print(f"imports against the layering: {len(r.layering)}")
    for line in r.layering:
        print(f"  {line}")
    print(f"loose top-level modules: {len(r.loose_modules)} {sorted(r.loose_modules)} (at most {MAX_LOOSE_MODULES})")
    print(
        f"longest module: {r.longest_module[0]} lines ({r.longest_module[1]}); over {MAX_MODULE_LINES}: "
        f"{len(r.long_modules)}"
    )
    for line in r.long_modules:
        print(f"  {line}")
    print(
        f"longest function: {r.longest_function[0]} lines ({r.longest_function[1]}); over {MAX_FUNCTION_LINES}: "
        f"{len(r.long_functions)}"
    )
    for line in r.long_functions:
        print(f"  {line}")
    print(
        f"widest constructor: {r.widest_constructor[0]} parameters ({r.widest_constructor[1]}); over "
        f"{MAX_INIT_PARAMS}: {len(r.wide_constructors)}"
    )
    for line in r.wide_constructors:
        print(f"  {line}")
    print(f"hooks assigned after construction: {len(r.late_hooks)}")
    for line in r.late_hooks:
        print(f"  {line}")
    return 1 if r.broken else 0


if __name__ == "__main__":
    sys.exit(main())
