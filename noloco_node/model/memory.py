"""Will a stage fit? An estimate of a stage's training memory from the model's config alone, made
before anything is allocated, so a node that cannot hold its stage refuses to start with the
numbers and the fix instead of dying out of memory mid-run.

Per parameter (fp32): the weights theta, their gradient, Adam's two moments, and for the outer
methods phi and m: 16 or 24 bytes. Per microbatch in flight: its saved input (b x T x h, fp32).
Past stage 0 at most one microbatch's autograd graph lives at a time (the compute thread
recomputes it in backward); stage 0 keeps the graph of each microbatch it has in flight (`graphs`:
a batch's, or two batches' under the overlap schedule). Under overlap every stage but the last
also keeps one copy of its weights (`weight_stash`). A graph's activations per decoder layer
follow Korthikanti et al. 2022 (34 b T h + 5 b a T^2 values per layer at 2 bytes; doubled here for
fp32), or only the layer inputs plus one layer's worth with activation checkpointing; the last
stage adds logits and their gradient (3 b T V fp32).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

GIB = 1 << 30


@dataclass(frozen=True)
class StageMemory:
    params: int
    state_bytes: int  # weights, gradients, Adam, phi and m
    saved_inputs_bytes: int
    activation_bytes: int
    outer: bool = True  # phi and m kept (noloco, diloco)

    @property
    def total(self) -> int:
        return self.state_bytes + self.saved_inputs_bytes + self.activation_bytes


def stage_params(config, layer_range: range, *, first: bool, last: bool) -> int:
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    kv = h * (config.num_key_value_heads or config.num_attention_heads) // config.num_attention_heads
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h  # attention, SwiGLU, two RMSNorms
    return len(layer_range) * per_layer + (v * h if first else 0) + ((v * h + h) if last else 0)


def estimate(config, layer_range: range, *, first: bool, last: bool, outer: bool, max_in_flight: int,
             microbatch: int, seq_len: int, checkpointing: bool, bytes_per_value: int = 4, graphs: int = 1,
             weight_stash: bool = False) -> StageMemory:
    params = stage_params(config, layer_range, first=first, last=last)
    state = params * 4 * ((6 if outer else 4) + weight_stash)
    b, t, h, a = microbatch, seq_len, config.hidden_size, config.num_attention_heads
    saved = 0 if first else max_in_flight * b * t * h * 4
    per_layer = (34 * b * t * h + 5 * b * a * t * t) * bytes_per_value // 2
    layers = len(layer_range)
    activations = (layers * b * t * h * bytes_per_value + per_layer) if checkpointing else layers * per_layer
    activations *= max(1, graphs)
    if last:
        activations += 3 * b * t * config.vocab_size * 4
    return StageMemory(params, state, saved, activations, outer)


def available_bytes(device) -> int | None:
    """Free memory on `device` (a torch.device): the GPU's free memory, or the host's available
    memory (MemAvailable) for cpu; None when unknown."""
    if device.type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def describe(m: StageMemory) -> str:
    kept = "weights, gradients, Adam, phi and m" if m.outer else "weights, gradients and Adam"
    return (f"{m.total / GIB:.2f} GiB ({m.params:,} parameters: {m.state_bytes / GIB:.2f} GiB for {kept}; "
            f"{m.saved_inputs_bytes / GIB:.2f} GiB of saved inputs; {m.activation_bytes / GIB:.2f} GiB "
            f"of activations)")
