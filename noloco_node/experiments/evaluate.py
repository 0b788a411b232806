"""Validation loss and replica weight spread from the theta snapshots the nodes of a cell wrote
(`join --snapshot-every K`), computed as the authors' evaluation does (docs/research.md, Experiments):

- validation loss: replica column d is evaluated with *fixed routing* (replica d of every stage)
  on the same held-out windows; the reported loss is the mean over the D columns (the average
  loss of the replica ensemble, not the loss of averaged weights);
- spread sigma: sqrt( sum over stages, replicas, parameters of (theta - mean_d theta)^2 /
  (D x total parameters) ), the RMS deviation of each replica from the replica mean.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from noloco_node.config import NodeConfig
from noloco_node.data.loader import PackedSequences
from noloco_node.errors import DataError
from noloco_node.node.manifest import load_run_inputs
from noloco_node.model.build import build_run_stage, run_model
from noloco_node.model.stage import LlamaStage

SNAPSHOT = re.compile(r"stage(\d+)-(\w{8})-(?:step(\d+)|final)\.safetensors$")


def held_out_windows(config: NodeConfig, count: int) -> tuple[torch.Tensor, torch.Tensor, object]:
    if config.data.holdout_fraction <= 0:
        raise DataError(
            "data.holdout_fraction: is 0, so the run holds no data out for evaluation; set it (e.g. 0.02) for the run"
        )
    corpus, tokenizer, _ = load_run_inputs(config)
    windows = PackedSequences(
        corpus,
        tokenizer,
        seq_len=config.model.seq_len,
        split="validation",
        holdout_fraction=config.data.holdout_fraction,
        seed=config.run.seed,
        shuffle_buffer=0,
    )
    inputs, labels = [], []
    for x, y in windows:
        inputs.append(x)
        labels.append(y)
        if len(inputs) == count:
            break
    if not inputs:
        raise DataError("data.holdout_fraction: no held-out window for validation; raise data.holdout_fraction")
    return torch.stack(inputs), torch.stack(labels), tokenizer


def _index(snapshot_dir: Path) -> dict[int | str, dict[tuple[int, str], Path]]:
    """step (or "final") -> {(stage, short peer id): file}."""
    found: dict[int | str, dict[tuple[int, str], Path]] = {}
    for path in snapshot_dir.glob("stage*.safetensors"):
        m = SNAPSHOT.search(path.name)
        if m:
            step = int(m.group(3)) if m.group(3) is not None else "final"
            found.setdefault(step, {})[(int(m.group(1)), m.group(2))] = path
    return found


def evaluation_points(
    index: dict[int | str, dict[tuple[int, str], Path]], columns: list[list[str]], final_step: int | None
) -> list[tuple[int, dict[tuple[int, str], Path], bool]]:
    """(step, files, is_final) in step order; the final snapshots, when every node wrote one,
    stand at `final_step` in place of that step's own snapshots."""
    index = dict(index)
    final = index.pop("final", None)
    points = [(step, files, False) for step, files in sorted(index.items())]
    complete = final is not None and all((s, peer) in final for column in columns for s, peer in enumerate(column))
    if complete and final_step is not None:
        points = [p for p in points if p[0] != final_step] + [(final_step, final, True)]
    return points


def evaluate_snapshots(
    config: NodeConfig,
    snapshot_dir: Path,
    columns: list[list[str]],
    *,
    eval_sequences: int,
    final_step: int | None = None,
) -> list[dict]:
    """`columns[d][s]` is the short peer id (last 8 chars) of replica d's stage-s node. Returns one
    row per step that every column has a snapshot of: step, val_loss (ensemble mean), spread.

    With `final_step`, the weights every node held when training ended (its -final snapshot) are
    the row at `final_step`, replacing a step row there: with random routing the replicas of a
    stage > 0 need not end on exactly the drivers' last step, so that step's row may be missing."""
    inputs, labels, tokenizer = held_out_windows(config, eval_sequences)
    p = config.pipeline
    llama, ranges = run_model(config, len(tokenizer))
    stages = [build_run_stage(config, llama, ranges, s) for s in range(p.num_stages)]
    for stage in stages:
        stage.eval()
    rows = []
    points = evaluation_points(_index(snapshot_dir), columns, final_step)
    for step, files, is_final in points:
        wanted = [[files.get((s, peer)) for s, peer in enumerate(column)] for column in columns]
        if any(f is None for column in wanted for f in column):
            continue  # a node left before this step: the step is not comparable
        weights = [[load_file(str(f)) for f in column] for column in wanted]
        losses = column_losses(stages, weights, inputs, labels)
        rows.append(
            {
                "step": step,
                "val_loss": sum(losses) / len(losses),
                "column_losses": losses,
                "spread": weight_spread(weights),
                "final": is_final,
            }
        )
    return rows


def column_losses(
    stages: list[LlamaStage], columns: list[list[dict[str, torch.Tensor]]], inputs: torch.Tensor, labels: torch.Tensor
) -> list[float]:
    """The reference's evaluation: column d routes every sequence through replica d of each stage
    (fixed routing); one held-out loss per column (their mean is the ensemble's val_loss)."""
    losses = []
    with torch.no_grad():
        for column in columns:
            for stage, tensors in zip(stages, column):
                for name, param in stage.named_parameters():
                    param.copy_(tensors[name])
            hidden = inputs
            for stage in stages[:-1]:
                hidden = stage(hidden, inputs)
            losses.append(float(stages[-1](hidden, inputs, labels)))
    return losses


def weight_spread(weights: list[list[dict[str, torch.Tensor]]]) -> float:
    """sigma over replicas (outer list) of every stage's tensors (inner list of name -> tensor)."""
    replicas = len(weights)
    total_sq, total_params = 0.0, 0
    for s in range(len(weights[0])):
        for name in weights[0][s]:
            stacked = torch.stack([weights[d][s][name].double() for d in range(replicas)])
            total_sq += float((stacked - stacked.mean(0)).pow(2).sum())
            total_params += stacked[0].numel()
    return math.sqrt(total_sq / (replicas * total_params))


def replica_spread(per_stage: list[list[dict[str, torch.Tensor]]]) -> float:
    """sigma of every stage's replicas (inner list) around their stage's mean, pooled over the stages
    that have two or more (0.0 when none has): `weight_spread` when every stage has D replicas, and
    still the spread when one stage has fewer (live `eval` once said 0 for two stage-1 replicas 700
    steps apart because stage 0 had one, so there was one column)."""
    total_sq, total_params = 0.0, 0
    for replicas in per_stage:
        if len(replicas) < 2:
            continue
        for name in replicas[0]:
            stacked = torch.stack([r[name].double() for r in replicas])
            total_sq += float((stacked - stacked.mean(0)).pow(2).sum())
            total_params += stacked.numel()
    return math.sqrt(total_sq / total_params) if total_params else 0.0


def pearson(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    if n < 3:
        return float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx == 0 or syy == 0:
        return float("nan")
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / math.sqrt(sxx * syy)
