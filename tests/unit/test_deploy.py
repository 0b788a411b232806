"""deploy/ stays in step with the code: every command in the Dockerfile, compose file and
systemd units parses with the real CLI parser, and the example config names every field."""

import dataclasses
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


def test_systemd_units_run_valid_commands():
    for unit in sorted((DEPLOY / "systemd").glob("*.service")):
        text = unit.read_text().replace("\\\n", " ")
        line = next(l for l in text.splitlines() if l.startswith("ExecStart="))
        argv = shlex.split(line.removeprefix("ExecStart="))
        assert argv[0].endswith("/noloco-node")
        parses(argv[1:])


def test_compose_services_run_valid_commands():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert {"bootstrap", "node-a", "node-b"} <= set(compose["services"])
    for name, service in compose["services"].items():
        if "entrypoint" in service:
            script = service["entrypoint"][-1]
            script = re.sub(r"\$\$\(.*?\)", MADDR, script)
            argv = shlex.split(script.removeprefix("exec "))
            assert argv[0] == "noloco-node", name
            parses(argv[1:])
        else:
            parses(service["command"])


def test_dockerfile_default_command_parses():
    text = (DEPLOY / "Dockerfile").read_text()
    cmd = re.search(r'^CMD (\[.*\])$', text, re.M).group(1)
    parses(yaml.safe_load(cmd) + ["--initial-peers", MADDR])
    assert re.search(r'^ENTRYPOINT \["noloco-node"\]$', text, re.M)
