"""Config: defaults per method, file + flag precedence, and errors that name the field and fix."""

import pytest

from noloco_node.config import ConfigError, NodeConfig, load_config


def test_method_defaults_follow_the_reference():
    noloco = load_config().outer
    assert (noloco.inner_steps_per_outer, noloco.alpha, noloco.beta, noloco.gamma) == (50, 0.5, 0.7, 0.7)
    diloco = load_config(overrides=["outer.method=diloco"]).outer
    assert (diloco.inner_steps_per_outer, diloco.alpha, diloco.beta) == (100, 0.3, 0.7)
    inner = NodeConfig().inner
    assert (inner.lr, inner.warmup_steps, inner.total_steps, inner.min_lr_ratio, inner.clip_norm) == (
        6e-4,
        1000,
        25000,
        0.1,
        1.0,
    )


PEER = "/ip4/127.0.0.1/tcp/1/p2p/QmaCpDMGvV2BGHeYERUEnRQAwe3N8SzbUtfsmvsqQLuvuJ"


def test_file_then_flags_precedence(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text(f'[outer]\nalpha = 0.4\ncodec = "int8"\n[network]\ninitial_peers = ["{PEER}"]\n')
    config = load_config(path, ["outer.alpha=0.45"], base={"outer": {"alpha": 0.1, "beta": 0.6}})
    assert config.outer.alpha == 0.45 and config.outer.codec == "int8" and config.outer.beta == 0.6
    assert config.network.initial_peers == (PEER,)


@pytest.mark.parametrize(
    "overrides,field,fix",
    [
        (["outer.alpha=abc"], "outer.alpha", "float"),
        (["outer.alfa=0.3"], "outer.alfa", "did you mean 'alpha'"),
        (["outer.alpha=1.5"], "outer.alpha", "0.5"),
        (["outer.method=fedavg"], "outer.method", "noloco"),
        (["pipeline.stage=4"], "pipeline.stage", "below num_stages"),
        (["pipeline.num_stages=9"], "pipeline.num_stages", "model.num_layers"),
        (["model.num_heads=3"], "model.num_heads", "divides hidden_size"),
        (["timeouts.rpc_s=-1"], "timeouts.rpc_s", "positive"),
        (["netwrk.port=1"], "netwrk", "did you mean 'network'"),
        (["network.announce_addr=nowhere"], "network.announce_addr", "host:port"),
        (["alpha=0.5"], "alpha", "section.field=value"),
        # host:port where a multiaddr goes was refused only once the DHT daemon tried it, as unreachable
        (
            ["network.initial_peers=127.0.0.1:31330"],
            "network.initial_peers",
            "the whole multiaddr the bootstrap printed",
        ),
        (["network.relays=/ip4/203.0.113.7/tcp/31330"], "network.relays", "/p2p/"),
    ],
)
def test_bad_values_name_field_and_fix(overrides, field, fix):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    assert info.value.field == field
    assert fix in str(info.value)


def test_bad_file(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[outer\nalpha=1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    typed = tmp_path / "typed.toml"
    typed.write_text("[pipeline]\nbatch_size = 2.5\n")
    with pytest.raises(ConfigError, match="pipeline.batch_size"):
        load_config(typed)


def test_manifest_hash_tracks_run_defining_fields_only():
    base = NodeConfig()
    assert base.manifest_hash() == load_config(overrides=["network.port=1234", "pipeline.stage=1"]).manifest_hash()
    assert base.manifest_hash() != load_config(overrides=["outer.alpha=0.4"]).manifest_hash()
    assert base.manifest_hash() != base.manifest_hash("tokenizer:abc")


def test_codec_none_is_the_lossless_codec_not_unset():
    from noloco_node.config import load_config

    config = load_config(overrides=["outer.codec=bf16", "outer.codec_delta=none", "outer.codec_phi=none"])
    assert config.outer.codec_delta == "none" and config.outer.codec_phi == "none"
    unset = load_config(overrides=["outer.codec=bf16", "outer.codec_delta=null"])
    assert unset.outer.codec_delta == "bf16"  # null still means "use outer.codec"


@pytest.mark.parametrize(
    "field,value,says",
    [
        ("codec_phi", "topk:0.02", "is for Delta"),
        ("codec_delta", "slice:0.1", "is for phi"),
        ("codec_delta", "topk:0.02+int3", "+int2 or +int4"),
        ("codec_phi", "slice:0", "fraction must be in (0, 1]"),
    ],
)
def test_an_outer_codec_in_the_wrong_place_names_the_field_and_the_fix(field, value, says):
    with pytest.raises(ConfigError, match=f"outer.{field}") as info:
        load_config(overrides=[f"outer.{field}={value}"])
    assert says in str(info.value) and "e.g." in str(info.value)
    config = load_config(overrides=["outer.codec_phi=slice:0.01", "outer.codec_delta=topk:0.02+int2"])
    assert (config.outer.codec_phi, config.outer.codec_delta) == ("slice:0.01", "topk:0.02+int2")


def test_a_mistyped_peer_id_in_initial_peers_is_a_config_error_at_once():
    """A newcomer's typo in the bootstrap's peer id failed only after 23 s, as an unreachable
    bootstrap (exit 3): an id that cannot be one is refused before anything starts."""
    from noloco_node.config import ConfigError, build_config

    good = "/ip4/127.0.0.1/tcp/31330/p2p/QmQsqaCr7huWkxQvXBbzXkEz9ChW9S9vGuvMxDSSYgbyCY"
    assert build_config({"network": {"initial_peers": [good]}}).network.initial_peers == (good,)
    for bad in (good[:-1], good + "Y", good.replace("Qsqa", "Q0qa")):
        with pytest.raises(ConfigError, match="is not a peer id") as error:
            build_config({"network": {"initial_peers": [bad]}})
        assert "network.initial_peers" in str(error.value) and "copy the multiaddr" in str(error.value)


def test_a_trailing_slash_or_comma_separated_multiaddrs_are_refused_with_the_fix():
    """Seen: "MADDR/" joined, then every heartbeat's re-dial of the bootstrap raised in a task nobody
    read (so a restarted bootstrap never re-learned that node); "A,B" failed after 27 s in hivemind."""
    from noloco_node.config import ConfigError, build_config

    good = "/ip4/127.0.0.1/tcp/31330/p2p/QmQsqaCr7huWkxQvXBbzXkEz9ChW9S9vGuvMxDSSYgbyCY"
    circuit = f"{good}/p2p-circuit/p2p/{PEER[-46:]}"
    assert build_config({"network": {"initial_peers": [circuit]}}).network.initial_peers == (circuit,)
    for bad, says in ((good + "/", "drop the trailing '/'"), (f"{good},{PEER}", "--initial-peers A B")):
        with pytest.raises(ConfigError, match="network.initial_peers") as error:
            build_config({"network": {"initial_peers": [bad]}})
        assert says in str(error.value)


def test_every_unknown_name_is_named_at_once(tmp_path):
    """A file with three typos was fixed one run at a time: the error named only the first."""
    path = tmp_path / "node.toml"
    path.write_text("[outer]\nalfa = 0.4\n[inner]\nlrr = 0.001\n[netwrk]\nport = 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert info.value.field == "outer.alfa" and "did you mean 'alpha'" in message
    assert "and 2 more unknown: 'inner.lrr', 'netwrk'" in message
    assert "'inner.lrr': did you mean 'lr'?" in message and "'netwrk': did you mean 'network'?" in message


def test_the_default_cache_follows_xdg_cache_home_and_a_named_one_stays(monkeypatch, tmp_path):
    """Seen by a newcomer: checkpoints followed $XDG_STATE_HOME, the corpus and tokenizer cache
    went to ~/.cache whatever $XDG_CACHE_HOME said."""
    from pathlib import Path

    from noloco_node.config import build_config

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert build_config({}).data.cache_path == tmp_path / "noloco-node"
    assert build_config({"data": {"cache_dir": "~/mine"}}).data.cache_path == Path("~/mine").expanduser()
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert build_config({}).data.cache_path == Path("~/.cache/noloco-node").expanduser()
