"""The wire contract says what the node does. proto/README.md and the .proto comments name every
status code a servicer can answer for each method (and no code it cannot), every pointer to
proto/README in the package names a heading that exists, every codec's layout is documented, and
the signing rules the contract states are the admission interceptor's."""

import ast
import asyncio
import re
from pathlib import Path

import grpc
import pytest

from noloco_node.rpc.admission import ANONYMOUS_PREFIXES, OPEN_PREFIXES, AdmissionInterceptor
from noloco_node.rpc.guard import GuardLimits, PeerGuard
from noloco_node.rpc.status import TO_STATUS
from noloco_node.transport.credentials import CallAuthError, CallSigner, CallVerifier
from noloco_node.transport.identity import NodeIdentity
from noloco_node.wire.v1 import diag_pb2, outer_pb2, stage_pb2, tensor_pb2

ROOT = Path(__file__).resolve().parents[3]
CONTRACT = ROOT / "proto" / "README.md"
PROTO_DIR = ROOT / "proto" / "noloco_node" / "wire" / "v1"
PACKAGE = ROOT / "noloco_node"
SERVICE_MODULES = (stage_pb2, outer_pb2, diag_pb2)
SERVICERS = {
    "Stage": ("rpc/stage_service.py", "StageServicer"),
    "Outer": ("rpc/outer_service.py", "OuterServicer"),
    "Diagnostics": ("rpc/diagnostics.py", "DiagnosticsServicer"),
}
# Methods whose servicer hands the call to a class of its own module.
METHOD_SERVICERS = {("Outer", "FetchState"): ("rpc/state_service.py", "StateDonorServicer")}
# What gRPC itself may answer whatever a servicer does: an unreachable or stopping node, a passed
# deadline, a cancelled call, a service the node does not register, its message and call limits.
GRPC_OWN = {
    "CANCELLED",
    "DEADLINE_EXCEEDED",
    "UNAVAILABLE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "RESOURCE_EXHAUSTED",
    "UNKNOWN",
}
POINTER = re.compile(r"proto/README(\.md)?(?:: ([A-Z][A-Za-z ]*[a-z]))?")


def _contract() -> str:
    return CONTRACT.read_text()


def _headings(text: str) -> list[str]:
    return [line.lstrip("#").strip() for line in text.splitlines() if re.match(r"#{1,6} ", line)]


def _section(text: str, heading: str) -> str:
    """The text under `heading` up to the next heading of the same or a higher level."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        match = re.match(r"(#{1,6}) (.*)", line)
        if match and match.group(2).strip() == heading:
            level = len(match.group(1))
            end = next((j for j in range(i + 1, len(lines)) if re.match(rf"#{{1,{level}}} ", lines[j])), len(lines))
            return "\n".join(lines[i + 1 : end])
    raise AssertionError(f"proto/README.md has no heading {heading!r}")


def _documented_codes(section: str) -> set[str]:
    return set(re.findall(r"^\| `([A-Z_]+)` \|", section, re.M))


def _methods() -> list[tuple[str, str]]:
    return [
        (service.name, method.name)
        for module in SERVICE_MODULES
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    ]


def _aborted_codes(functions: list[ast.AST]) -> set[str]:
    """Codes named as the first argument of `context.abort(...)`, plus every code of
    rpc/status.py's mapping (and its INTERNAL fallback) where `status_of` or `abort_with` is used."""
    codes: set[str] = set()
    for function in functions:
        for node in ast.walk(function):
            if isinstance(node, ast.Name) and node.id in ("status_of", "abort_with"):
                codes |= {code.name for code in TO_STATUS.values()} | {"INTERNAL"}
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "abort":
                first = node.args[0] if node.args else None
                if (
                    isinstance(first, ast.Attribute)
                    and isinstance(first.value, ast.Attribute)
                    and first.value.attr == "StatusCode"
                ):
                    codes.add(first.attr)
    return codes


def _class(path: Path, name: str) -> ast.ClassDef:
    return next(n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef) and n.name == name)


def _reachable(cls: ast.ClassDef, method: str) -> list[ast.AST]:
    """The method and every method of its class it calls through `self.`, transitively."""
    defs = {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    seen, todo = [], [method]
    while todo:
        name = todo.pop()
        if name in seen or name not in defs:
            continue
        seen.append(name)
        todo += [
            n.func.attr
            for n in ast.walk(defs[name])
            if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Name)
            and n.func.value.id == "self"
        ]
    assert seen, f"{cls.name} has no method {method}"
    return [defs[name] for name in seen]


def _admission_codes() -> set[str]:
    return _aborted_codes([_class(PACKAGE / "rpc" / "admission.py", "AdmissionInterceptor")])


def _returnable(service: str, method: str) -> set[str]:
    module, cls = METHOD_SERVICERS.get((service, method), SERVICERS[service])
    return {"OK"} | _aborted_codes(_reachable(_class(PACKAGE / module, cls), method)) | _admission_codes()


def test_the_admission_codes_are_found():
    # Guards the collector itself: if it found nothing, every check below would pass vacuously.
    assert _admission_codes() == {"UNAUTHENTICATED", "RESOURCE_EXHAUSTED"}
    assert {"FAILED_PRECONDITION", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED"} <= _returnable("Stage", "Backward")


@pytest.mark.parametrize("service, method", _methods())
def test_every_status_a_method_can_return_is_documented_for_it(service, method):
    documented = _documented_codes(_section(_contract(), f"{service}.{method}"))
    returnable = _returnable(service, method)
    assert returnable <= documented, f"{service}.{method}: undocumented {sorted(returnable - documented)}"
    assert documented <= returnable | GRPC_OWN, (
        f"{service}.{method}: documented but never returned {sorted(documented - returnable - GRPC_OWN)}"
    )


@pytest.mark.parametrize("proto", ["stage.proto", "outer.proto", "diag.proto"])
def test_proto_status_rules_match_the_servicers(proto):
    text = (PROTO_DIR / proto).read_text()
    header = text[: text.index("syntax =")]
    listed = set(re.findall(r"^//\s{2,}([A-Z_]{2,})\s{2,}", header, re.M))
    services = [
        name
        for module in SERVICE_MODULES
        if module.DESCRIPTOR.name.endswith(proto)
        for name in module.DESCRIPTOR.services_by_name
    ]
    returnable = set().union(*(_returnable(s, m) for s, m in _methods() if s in services)) - {"OK"}
    assert returnable <= listed, f"{proto}: status rules miss {sorted(returnable - listed)}"
    never = listed - returnable - GRPC_OWN - {"OK"}
    assert not never, f"{proto}: promises codes the node never answers: {sorted(never)}"
    entry = re.search(r"^//\s{2,}UNAUTHENTICATED\s+(.*?)(?=^//\s{2,}[A-Z_]{2,}\s|\Z)", header, re.M | re.S).group(1)
    assert "signed" in entry, f"{proto}: UNAUTHENTICATED must say the call is signed"
    if not any(f"/noloco.wire.v1.{s}/" in ANONYMOUS_PREFIXES for s in services):
        # Every call to these services is signed, keyed swarm or not.
        assert not re.search(r"swarm key is configured|in a swarm with a key", entry), entry


def _string_constants(path: Path) -> list[str]:
    return [
        n.value
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]


def test_pointers_to_the_contract_name_headings_that_exist():
    headings = set(_headings(_contract()))
    texts = [
        (str(p.relative_to(ROOT)), s)
        for p in PACKAGE.rglob("*.py")
        if "wire/v1" not in str(p)
        for s in _string_constants(p)
    ]
    texts += [(str(p.relative_to(ROOT)), p.read_text()) for p in PROTO_DIR.glob("*.proto")]
    pointers = [(where, m) for where, text in texts if "proto/README" in text for m in POINTER.finditer(text)]
    assert any(where.endswith("credentials.py") for where, _ in pointers), (
        "the unsigned-call error points at the contract"
    )
    for where, match in pointers:
        assert match.group(1) == ".md", f"{where}: write proto/README.md, the file's name"
        if match.group(2) is not None:
            assert match.group(2) in headings, f"{where}: proto/README.md has no heading {match.group(2)!r}"


def test_every_wire_codec_has_its_layout_documented():
    table = _section(_contract(), "Tensors on the wire")
    for name in tensor_pb2.Codec.keys():
        if name != "CODEC_UNSPECIFIED":
            assert re.search(rf"^\| `{name}` \|", table, re.M), f"{name} has no layout in proto/README.md"


def test_the_signing_table_is_the_admission_rule():
    rows = dict(re.findall(r"^\| `([\w.]+)` \| ([^|]+?) \|", _section(_contract(), "Which calls must be signed"), re.M))
    services = {f"noloco.wire.v1.{s}" for s, _ in _methods()} | {p.strip("/") for p in OPEN_PREFIXES}
    assert set(rows) == services
    for service, rule in rows.items():
        prefix = f"/{service}/"
        expected = (
            "never"
            if prefix in OPEN_PREFIXES
            else "optional in an open swarm"
            if prefix in ANONYMOUS_PREFIXES
            else "always"
        )
        assert rule == expected, f"{service}: the contract says {rule!r}, admission does {expected!r}"


class _Context:
    """What the interceptor reads of a call arriving over TLS from 203.0.113.5."""

    def __init__(self, metadata=()) -> None:
        self.metadata = tuple(metadata)

    def auth_context(self):
        return {"transport_security_type": [b"ssl"]}

    def peer(self) -> str:
        return "ipv4:203.0.113.5:40000"

    def invocation_metadata(self):
        return self.metadata


SERVER, CALLER_ID = NodeIdentity.generate(), NodeIdentity.generate()
PROBE, FORWARD = "/noloco.wire.v1.Diagnostics/Probe", "/noloco.wire.v1.Stage/Forward"


def _interceptor(key: bytes | None) -> AdmissionInterceptor:
    guard = PeerGuard(
        GuardLimits(requests_per_s=10, burst=10, max_streams=4, ban_after_invalid=5, ban_s=1, ban_max_s=1)
    )
    return AdmissionInterceptor(
        verifier=CallVerifier(SERVER.peer_id, swarm_key=key, max_skew_s=60), swarm_key=key, guard=guard
    )


def test_unsigned_probes_are_anonymous_only_in_an_open_swarm_and_every_other_call_is_signed():
    open_swarm, keyed = _interceptor(None), _interceptor(b"k" * 32)
    assert open_swarm._prove(PROBE, _Context()) == ("anon@203.0.113.5", "direct")
    with pytest.raises(CallAuthError, match=r"unsigned call.*proto/README\.md: Signed calls"):
        open_swarm._prove(FORWARD, _Context())
    with pytest.raises(CallAuthError, match="unsigned call"):
        keyed._prove(PROBE, _Context())
    signed = CallSigner(CALLER_ID).metadata(FORWARD, SERVER.peer_id)
    assert open_swarm._prove(FORWARD, _Context(signed)) == (CALLER_ID.peer_id, "direct")
    # A probe that carries a token is checked like any call, even in an open swarm.
    made_for_forward = CallSigner(CALLER_ID).metadata(FORWARD, SERVER.peer_id)
    with pytest.raises(CallAuthError, match="does not verify"):
        open_swarm._prove(PROBE, _Context(made_for_forward))


def test_health_is_served_without_admission():
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: None)

    async def continuation(details):
        return handler

    class Details:
        def __init__(self, method: str) -> None:
            self.method = method

    async def handlers():
        interceptor = _interceptor(None)
        health = await interceptor.intercept_service(continuation, Details("/grpc.health.v1.Health/Check"))
        probe = await interceptor.intercept_service(continuation, Details(PROBE))
        return health, probe

    health, probe = asyncio.run(handlers())
    assert health is handler  # the servicer itself, no gate in front
    assert probe is not handler and probe.unary_unary is not handler.unary_unary  # behind the admission gate
