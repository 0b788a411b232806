"""deploy/ stays in step with the code: every command in the Dockerfile, compose file and
systemd units parses with the real CLI parser, and the example config names every field."""

import dataclasses
import json
import shutil
import subprocess
import re
import shlex
from pathlib import Path

import yaml

from noloco_node.cli.main import build_parser
from noloco_node.config import SECTIONS, load_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MADDR = "/ip4/10.0.0.1/tcp/31330/p2p/12D3KooWC9iPeg5yx8MPKDydmEzZbFyDDQL3AanYS6yEd9h7uLMW"


def parses(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    assert callable(args.run)


def test_example_config_loads_and_names_every_field():
    load_config(DEPLOY / "node.example.toml")
    text = (DEPLOY / "node.example.toml").read_text()
    for section, cls in SECTIONS.items():
        assert f"[{section}]" in text, section
        for f in dataclasses.fields(cls):
            assert re.search(rf"^#?\s*{f.name}\s*=", text, re.M), f"{section}.{f.name} missing from node.example.toml"


def entrypoint(args: list[str]) -> list[str]:
    """What deploy/docker-entrypoint.sh runs for `docker run IMAGE ARGS`: the script itself, run by
    sh with a `noloco-node` that prints its arguments."""
    import os
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as fake_bin:
        fake = Path(fake_bin) / "noloco-node"
        fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
        fake.chmod(0o755)
        env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}"}
        ran = subprocess.run(
            ["sh", str(DEPLOY / "docker-entrypoint.sh"), *args], env=env, capture_output=True, text=True, timeout=10
        )
    assert ran.returncode == 0, ran.stderr
    return ran.stdout.splitlines()


def unit_argv(unit: Path) -> list[str]:
    text = unit.read_text().replace("\\\n", " ")
    line = next(row for row in text.splitlines() if row.startswith("ExecStart="))
    return shlex.split(line.removeprefix("ExecStart="))


def test_systemd_units_run_valid_commands_as_a_user_they_create_with_a_config_they_install():
    sysusers = (DEPLOY / "systemd" / "noloco-node.sysusers").read_text()
    for unit in sorted((DEPLOY / "systemd").glob("*.service")):
        argv = unit_argv(unit)
        assert argv[0].endswith("/noloco-node")
        parses(argv[1:])
        user = re.search(r"^User=(\S+)$", unit.read_text(), re.M).group(1)
        assert re.search(rf"^u {user} ", sysusers, re.M), f"{unit.name}: nothing creates user {user}"
        assert "noloco-node.sysusers /etc/sysusers.d/" in unit.read_text(), f"{unit.name} does not say how to create it"
        # Every unit reads the swarm's config (the bootstrap too: it answers probes only for its run)
        # from a path its install lines fill from a file in the repository.
        config = argv[argv.index("--config") + 1]
        source = re.search(rf"install -D -m 644 (\S+) {re.escape(config)}", unit.read_text())
        assert source and (DEPLOY.parent / source.group(1)).is_file(), f"{unit.name}: nothing installs {config}"
        load_config(DEPLOY.parent / source.group(1))


def test_compose_services_run_valid_commands_and_every_node_trains_without_extra_flags():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert {"bootstrap", "node-a", "node-b"} <= set(compose["services"])
    for name, service in compose["services"].items():
        if "entrypoint" in service:
            script = re.sub(r"\$\$\(.*?\)", MADDR, service["entrypoint"][-1])
            argv = shlex.split(script.removeprefix("exec "))
            assert argv[0] == "docker-entrypoint.sh", name
            argv = entrypoint(argv[1:])
        else:
            argv = entrypoint(service["command"])
        args = build_parser().parse_args(argv)
        assert "--steps" not in argv, f"{name}: a node trains without --steps (and any stage ignores it)"
        if args.command == "join":
            assert args.initial_peers == [MADDR] and args.stage == "auto"
        if args.command in ("join", "bootstrap"):
            assert args.config == "/etc/noloco-node/node.toml", f"{name} must read the image's config"


def test_dockerfile_entrypoint_ports_healthcheck_and_build_context():
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r'^ENTRYPOINT \["docker-entrypoint.sh"\]$', text, re.M)
    assert "COPY deploy/docker-entrypoint.sh /usr/local/bin/docker-entrypoint.sh" in text
    assert "COPY deploy/node.example.toml /etc/noloco-node/node.toml" in text
    join = build_parser().parse_args(entrypoint(["--initial-peers", MADDR]))
    config = load_config(DEPLOY / "node.example.toml", join.overrides, base=None).network
    exposed = {int(p) for p in re.search(r"^EXPOSE (.*)$", text, re.M).group(1).split()}
    bootstrap_port = build_parser().parse_args(["bootstrap"]).port
    assert {join.port, config.dht_port, bootstrap_port} <= exposed
    # The healthcheck asks the default join's own gRPC health service.
    health = json.loads(re.search(r"^HEALTHCHECK .* CMD (\[.*\])$", text, re.M).group(1))
    assert health[0] == "docker-entrypoint.sh"
    health = entrypoint(health[1:])  # a node's health service (without a bootstrap's maddr file)
    assert health[0] == "health" and health[health.index("--address") + 1] == f"127.0.0.1:{join.port}"
    parses(health)
    # The example dials a bootstrap at the port a bootstrap listens on by default.
    assert f"/tcp/{bootstrap_port}/p2p/" in text and "/tcp/31337/p2p/" not in text
    ignored = (DEPLOY.parent / ".dockerignore").read_text().split()
    assert {".venv", "runs/", ".git"} <= set(ignored)


def test_the_bootstrap_publishes_the_swarm_page_on_the_port_it_exposes():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]["bootstrap"]
    listen = compose["command"][compose["command"].index("--dashboard") + 1]
    port = listen.rpartition(":")[2]
    assert listen.startswith("0.0.0.0:") and f"{port}:{port}" in compose["ports"]
    argv = unit_argv(DEPLOY / "systemd" / "noloco-bootstrap.service")
    assert argv[argv.index("--dashboard") + 1].startswith("0.0.0.0:")


def test_a_named_join_or_bootstrap_gets_the_images_config_ports_and_volume_and_your_flags_win():
    # An audit's `docker run IMAGE join ...` ran the built-in defaults (run 'local', a random port,
    # checkpoints in the container), and the docs' bootstrap line served run 'local'.
    join = build_parser().parse_args(entrypoint(["join", "--initial-peers", MADDR, "--port", "40000"]))
    assert join.config == "/etc/noloco-node/node.toml" and join.stage == "auto" and join.port == 40000
    assert "checkpoint.dir=/var/lib/noloco-node/ckpt" in join.overrides
    boot = build_parser().parse_args(entrypoint(["bootstrap", "--maddr-file", "/shared/bootstrap.maddr"]))
    assert boot.config == "/etc/noloco-node/node.toml" and boot.port == 31330 and boot.host == "0.0.0.0"
    assert boot.identity == "/var/lib/noloco-node/bootstrap.key"
    assert boot.maddr_file == ["/tmp/noloco-bootstrap.maddr", "/shared/bootstrap.maddr"]  # the healthcheck's, and yours
    assert entrypoint(["status", "--initial-peers", MADDR]) == ["status", "--initial-peers", MADDR]
    # The healthcheck: a node's health service on the image's port (no bootstrap's file here).
    assert entrypoint(["health"]) == ["health", "--address", "127.0.0.1:31337"]
    assert entrypoint(["health", "--address", "127.0.0.1:1"]) == ["health", "--address", "127.0.0.1:1"]


def test_units_stay_failed_on_a_bad_config_and_are_hardened():
    for unit in sorted((DEPLOY / "systemd").glob("*.service")):
        text = unit.read_text()
        assert re.search(r"^RestartPreventExitStatus=2 4$", text, re.M), unit.name
        for line in ("NoNewPrivileges=yes", "ProtectSystem=strict", "PrivateTmp=yes", "CapabilityBoundingSet="):
            assert re.search(rf"^{re.escape(line)}$", text, re.M), f"{unit.name}: {line}"
        if shutil.which("systemd-analyze"):  # its own rating, where the tool is installed (Debian: systemd)
            rated = subprocess.run(
                ["systemd-analyze", "security", "--offline=true", "--threshold=40", str(unit)],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert rated.returncode == 0, rated.stdout[-2000:] + rated.stderr[-2000:]
