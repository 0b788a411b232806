"""The trained model out of the swarm, as a standard Hugging Face model directory.

Stage checkpoints hold parameters under the whole `LlamaForCausalLM`'s names (model/stage.py),
so the stages of one run fit together into one state dict. The exported weights are the slow
weights phi (what the outer steps agree on) where a checkpoint holds them, else the fast weights
theta (the dp and none methods keep no phi). With several checkpoints of one stage, `average`
takes their mean; otherwise the newest is used.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

from noloco_node.config import NodeConfig

log = logging.getLogger(__name__)


class ExportError(ValueError):
    pass


def stage_weights(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], str]:
    """A stage's parameters from a checkpoint's tensors: phi if present, else theta."""
    for kind in ("phi", "theta"):
        found = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith(kind + "/")}
        if found:
            return found, kind
    raise ExportError("the checkpoint holds neither phi/ nor theta/ tensors")


def gather_checkpoints(dirs: list[Path], *, num_stages: int, manifest_hash: str) -> dict[int, list[tuple[dict, Path]]]:
    """stage -> [(meta, weights file)] of every checkpoint of this run found in `dirs`."""
    found: dict[int, list[tuple[dict, Path]]] = {}
    for directory in dirs:
        metas = sorted(Path(directory).expanduser().glob("stage*.json"))
        if not metas:
            raise ExportError(f"{directory} holds no node checkpoint (stage<N>.json); point --from-checkpoint at checkpoint.dir")
        for meta_path in metas:
            meta = json.loads(meta_path.read_text())
            if meta.get("manifest_hash") != manifest_hash:
                raise ExportError(f"{meta_path} is from another run or model (manifest {meta.get('manifest_hash')}, this "
                                  f"config gives {manifest_hash}); pass the run's --config / --set")
            found.setdefault(int(meta["stage"]), []).append((meta, meta_path.parent / meta["file"]))
    missing = [s for s in range(num_stages) if s not in found]
    if missing:
        raise ExportError(f"no checkpoint of stage(s) {missing}; every stage of the pipeline is needed")
    return found


def merge_stages(per_stage: dict[int, list[dict[str, torch.Tensor]]], average: bool) -> dict[str, torch.Tensor]:
    """One state dict from each stage's replicas' weights: their mean, or the first."""
    merged: dict[str, torch.Tensor] = {}
    for stage in sorted(per_stage):
        replicas = per_stage[stage]
        for name in replicas[0]:
            if average:
                merged[name] = torch.stack([r[name].double() for r in replicas]).mean(0).to(replicas[0][name].dtype)
            else:
                merged[name] = replicas[0][name]
    return merged


def weights_from_checkpoints(dirs: list[Path], config: NodeConfig, manifest_hash: str, *,
                             average: bool = False) -> tuple[dict[str, torch.Tensor], str]:
    found = gather_checkpoints(dirs, num_stages=config.pipeline.num_stages, manifest_hash=manifest_hash)
    per_stage, kinds = {}, set()
    for stage, entries in found.items():
        entries = sorted(entries, key=lambda e: -int(e[0].get("inner_step", 0)))
        chosen = entries if average else entries[:1]
        weights = []
        for meta, path in chosen:
            tensors, kind = stage_weights(load_file(str(path)))
            weights.append(tensors)
            kinds.add(kind)
            log.info("stage %d: %s from %s (inner step %s)", stage, kind, path, meta.get("inner_step"))
        per_stage[stage] = weights
    return merge_stages(per_stage, average), "+".join(sorted(kinds))


def write_model_dir(out: Path, llama_config, weights: dict[str, torch.Tensor], tokenizer) -> Path:
    """`config.json`, safetensors weights and the tokenizer: what from_pretrained(out) reads."""
    from transformers import LlamaForCausalLM

    llama_config = llama_config.__class__.from_dict(llama_config.to_dict())
    if getattr(tokenizer, "bos_token_id", None) is not None:
        llama_config.bos_token_id = tokenizer.bos_token_id
    if getattr(tokenizer, "eos_token_id", None) is not None:
        llama_config.eos_token_id = tokenizer.eos_token_id
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config)
    expected = set(model.state_dict())
    if set(weights) != expected:
        raise ExportError(f"the stages' weights do not make the whole model: missing {sorted(expected - set(weights))[:5]}, "
                          f"unexpected {sorted(set(weights) - expected)[:5]}")
    model.load_state_dict({k: v.contiguous() for k, v in weights.items()}, assign=True)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
