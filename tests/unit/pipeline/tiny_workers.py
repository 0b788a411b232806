"""A tiny Llama stage and its worker, for the pipeline worker's unit tests."""

from noloco_node.model.stage import build_stage, llama_config
from noloco_node.optim.inner import InnerOptimizer, InnerSchedule
from noloco_node.pipeline.worker import StageWorker, WorkerSettings

HIDDEN, SEQ, VOCAB = 16, 8, 32


def tiny_worker(
    stage_index: int,
    num_stages: int,
    *,
    batch_size: int,
    auto_step: bool,
    defer_step: bool = False,
    stash_weights: bool = False,
    device_codecs: tuple[str | None, str | None] = (None, None),
) -> StageWorker:
    config = llama_config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_layers=num_stages, num_heads=2, max_seq_len=SEQ
    )
    stage = build_stage(config, seed=0, stage_index=stage_index, num_stages=num_stages)
    inner = InnerOptimizer(stage.parameters(), InnerSchedule(lr_max=1e-2, warmup_steps=1, total_steps=10))
    settings = WorkerSettings(
        batch_size=batch_size,
        saved_ttl_s=60.0,
        auto_step=auto_step,
        defer_step=defer_step,
        stash_weights=stash_weights,
        device_codecs=device_codecs,
    )
    return StageWorker(stage, inner, settings)
