"""A config written as TOML reads back to the same config (the demo writes its run's config so
`export`/`eval --config` can name it)."""

import dataclasses

from noloco_node.config import load_config
from noloco_node.config.dump import to_toml

PEER = "/ip4/127.0.0.1/tcp/31330/p2p/12D3KooWC9iPeg5yx8MPKDydmEzZbFyDDQL3AanYS6yEd9h7uLMW"


def test_defaults_and_changed_fields_of_every_kind_read_back_equal(tmp_path):
    config = load_config(
        None,
        {
            "run": {"run_id": 'a "quoted" run\\x'},
            "inner": {"lr": "3e-3", "total_steps": "40", "warmup_steps": "4"},
            "outer": {"overlap": "false"},
            "network": {"initial_peers": [PEER]},
        },
    )
    path = tmp_path / "run.toml"
    path.write_text(to_toml(config.to_dict(), header="written by a test\nsecond line"))
    assert path.read_text().startswith("# written by a test\n# second line\n\n[run]\n")
    again = load_config(path)
    assert dataclasses.asdict(again) == dataclasses.asdict(config)
    assert again.manifest_hash("x") == config.manifest_hash("x")
