"""The pipeline's oracle, shared by the in-process and the process tests: the whole
LlamaForCausalLM trained in one process on the same data, with the same per-stage clipping."""

from noloco_node.data.loader import PackedSequences, ShardSpec
from noloco_node.model.build import run_model
from noloco_node.model.stage import LlamaStage, build_full_model
from noloco_node.optim.inner import InnerOptimizer, InnerSchedule


def stage_of(name: str, ranges: list[range]) -> int:
    if name.startswith("model.embed_tokens"):
        return 0
    if name.startswith(("model.norm", "lm_head")):
        return len(ranges) - 1
    layer = int(name.split(".")[2])
    return next(s for s, r in enumerate(ranges) if layer in r)


def train_whole_model(config, corpus, tokenizer, steps):
    """(per-microbatch losses, state dict) after `steps` inner steps of the whole model."""
    m, inner = config.model, config.inner
    llama, ranges = run_model(config, len(tokenizer))  # the nodes' split (by cost)
    model = build_full_model(llama, config.run.seed, subspace_rank=config.model.residual_subspace)
    schedule = InnerSchedule(
        lr_max=inner.lr, warmup_steps=inner.warmup_steps, total_steps=inner.total_steps, min_lr_ratio=inner.min_lr_ratio
    )
    num_stages = config.pipeline.num_stages
    groups = [[p for n, p in model.named_parameters() if stage_of(n, ranges) == s] for s in range(num_stages)]
    optimizers = [InnerOptimizer(g, schedule, clip_norm=inner.clip_norm) for g in groups]  # clipping per stage
    batches = PackedSequences(
        corpus,
        tokenizer,
        seq_len=m.seq_len,
        shard=ShardSpec(),
        holdout_fraction=0.0,
        seed=config.run.seed,
        shuffle_buffer=0,
    ).batches(config.pipeline.batch_size)
    micro, batch_size = config.pipeline.microbatch_size, config.pipeline.batch_size
    losses = []
    for _ in range(steps):
        inputs, labels = next(batches)
        for i in range(0, batch_size, micro):
            loss = LlamaStage.loss(model(input_ids=inputs[i : i + micro]).logits, labels[i : i + micro])
            (loss * (micro / batch_size)).backward()
            losses.append(loss.item())
        for optimizer in optimizers:
            optimizer.step()
    return losses, model.state_dict()
