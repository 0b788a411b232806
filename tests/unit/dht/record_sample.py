"""A valid stage record for tests, any field overridden (run 'dash', a serving replica)."""

from noloco_node.dht.records import StageRecord


def record(peer: str, stage: int, **fields) -> StageRecord:
    values = dict(
        peer_id=peer,
        address=f"127.0.0.1:{4000 + stage}",
        stage=stage,
        inner_step=10,
        outer_round=2,
        status="serving",
        tokens_per_s=100.0,
        version="0.2.0",
        manifest_hash="m" * 16,
        run_id="dash",
        updated_at=1000.0,
        capacity=5.0,
        tls_cert="AAAA",
    )
    values.update(fields)
    return StageRecord(**values)
