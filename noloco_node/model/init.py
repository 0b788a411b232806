"""Where a stage's phi_0 comes from, one parameter at a time: from the run seed and the parameter's
name, or from a Hugging Face checkpoint read lazily. Nothing here ever holds another stage's
tensors, so a node needs host memory for its own stage only.

From the seed (`INIT_SCHEME`): the parameter named `name` (its name in the whole
`LlamaForCausalLM`, e.g. `model.layers.7.mlp.up_proj.weight`) gets values that depend only on the
run seed, that name and its shape, never on which other parameters exist, so every split of the
same run gives a shared parameter the same bits, and the whole model in one process equals its
stages put together. The distributions are transformers' `PreTrainedModel._init_weights` for a
Llama: Linear and Embedding weights ~ N(0, initializer_range) (an Embedding's padding row zero),
biases zero, RMSNorm weights one; the rotary buffers are computed, not drawn.

The normals are drawn on the CPU in float64 and rounded to float32, whatever the device: PyTorch's
float32 sampler has a vectorised AVX2 path whose last bits need not match its scalar path (ARM,
older x86), while float64 goes through the scalar path and libm, whose sub-ulp differences almost
never survive the rounding. Seen: the same bits from torch 2.13 on this 2-core x86 and torch 2.11
on an AVX-512 Xeon, with 1, 2 or 16 threads, built on the CPU or on a CUDA device.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

# Enters the run manifest: peers whose phi_0 rule differs never train together. Bump it whenever a
# change below changes any value.
INIT_SCHEME = "phi0-by-name/v1"
_BLOCK = 1 << 20  # elements drawn per float64 buffer fill (8 MiB); part of the scheme


def parameter_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from the run seed and a parameter's global name (stable across
    processes and machines, unlike Python's hash)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def normal_(out: torch.Tensor, std: float, seed: int, buffer: torch.Tensor | None = None) -> None:
    """Fill `out` (any device or float dtype) with N(0, std) drawn on the CPU in float64 from a
    generator seeded with `seed`, in row-major order, one block of `_BLOCK` at a time (through
    `buffer`, float64 of >= `_BLOCK` elements, if given)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    flat = out.view(-1)
    if buffer is None:
        buffer = torch.empty(min(_BLOCK, flat.numel()), dtype=torch.float64)
    for start in range(0, flat.numel(), _BLOCK):
        block = buffer[: min(_BLOCK, flat.numel() - start)]
        block.normal_(0.0, std, generator=gen)
        flat[start : start + block.numel()].copy_(block)


def _is_norm(module: nn.Module) -> bool:
    # transformers matches norms by class name too: each model has its own RMSNorm class.
    return "RMSNorm" in type(module).__name__ or "LayerNorm" in type(module).__name__


def _fill(
    module: nn.Module, leaf: str, name: str, out: torch.Tensor, *, seed: int, std: float, buffer: torch.Tensor
) -> None:
    if leaf == "bias":
        out.zero_()
    elif _is_norm(module) and leaf == "weight":
        out.fill_(1.0)
    elif isinstance(module, (nn.Linear, nn.Embedding)) and leaf == "weight":
        normal_(out, std, parameter_seed(seed, name), buffer)
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            out[module.padding_idx].zero_()
    else:
        raise TypeError(
            f"no phi_0 rule for {name} ({type(module).__name__}.{leaf}): add one to model/init.py and bump INIT_SCHEME"
        )


def materialise_from_seed(
    model: nn.Module,
    *,
    seed: int,
    initializer_range: float | None,
    device: torch.device | str = "cpu",
    threads: int | None = None,
) -> int:
    """Give every parameter of `model` still on the meta device real float32 storage on `device`,
    filled by the rule in the module docstring; `model`'s parameter names must be the whole
    model's. Parameters are drawn on `threads` threads (default torch's intra-op count): each has
    its own generator, so the values do not depend on it. Returns the number materialised."""
    std = initializer_range or 0.02  # transformers' own fallback
    todo = list(_meta_parameters(model))
    # One draw buffer per thread, reused: a fresh 8 MiB one per parameter left ~56 MiB of freed
    # heap per decoder layer that glibc kept (measured: VmHWM grew 312 MiB per 256 MiB layer).
    buffers: dict[int, torch.Tensor] = {}

    def fill(item) -> nn.Parameter:
        module, leaf, name, param = item
        buffer = buffers.get(threading.get_ident())
        if buffer is None:
            buffer = buffers[threading.get_ident()] = torch.empty(_BLOCK, dtype=torch.float64)
        out = torch.empty(param.shape, dtype=torch.float32, device=device)
        _fill(module, leaf, name, out, seed=seed, std=std, buffer=buffer)
        return nn.Parameter(out, requires_grad=param.requires_grad)

    workers = max(1, min(threads or torch.get_num_threads(), len(todo)))
    with ThreadPoolExecutor(workers, thread_name_prefix="phi0") as pool:  # the samplers release the GIL
        filled = list(pool.map(fill, todo))
    for (module, leaf, _, _), param in zip(todo, filled):
        setattr(module, leaf, param)
    _refuse_meta(model)
    return len(todo)


def _meta_parameters(model: nn.Module):
    """(module, attribute, global name, parameter) of every parameter still on the meta device."""
    for module_name, module in model.named_modules():
        for leaf, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                yield module, leaf, f"{module_name}.{leaf}" if module_name else leaf, param


@dataclass
class CheckpointReads:
    """What `materialise_from_checkpoint` read: tensors and bytes as stored in the files."""

    tensors: int = 0
    bytes: int = 0
    names: list[str] = field(default_factory=list)


def checkpoint_weight_files(directory: str | Path) -> list[Path]:
    """A checkpoint directory's weight files: its *.safetensors, else its pytorch_model*.bin
    (empty if it has neither)."""
    root = Path(directory).expanduser()
    return sorted(root.glob("*.safetensors")) or sorted(root.glob("pytorch_model*.bin"))


class _Checkpoint:
    """The tensors of a checkpoint directory's weight files, opened lazily: safetensors files
    through `safe_open` (only the header is read until a tensor is asked for), `.bin` files
    memory-mapped."""

    def __init__(self, files: list[Path]) -> None:
        from safetensors import safe_open

        self._where: dict[str, object] = {}
        for path in files:
            if path.suffix == ".safetensors":
                handle = safe_open(str(path), framework="pt", device="cpu")
                for key in handle.keys():
                    self._where[key] = handle
            else:
                state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
                for key in state:
                    self._where[key] = state

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        source = self._where[name]
        return source[name] if isinstance(source, dict) else source.get_tensor(name)


def materialise_from_checkpoint(
    model: nn.Module, directory: str | Path, *, device: torch.device | str = "cpu"
) -> CheckpointReads:
    """Give every parameter of `model` still on the meta device the tensor of the same name in the
    checkpoint directory's weight files, in float32 on `device`, reading no other tensor. A
    checkpoint that ties its LM head to the embedding (no `lm_head.weight` stored) gives the head
    a copy of the embedding."""
    files = checkpoint_weight_files(directory)
    if not files:
        raise ValueError(f"{directory} holds no *.safetensors or pytorch_model*.bin weights")
    checkpoint, reads = _Checkpoint(files), CheckpointReads()
    for module, leaf, name, param in list(_meta_parameters(model)):
        stored = name if name in checkpoint or name != "lm_head.weight" else "model.embed_tokens.weight"
        if stored not in checkpoint:
            raise ValueError(
                f"the checkpoint {directory} has no tensor {name!r}: is it a Llama checkpoint "
                "saved by save_pretrained, matching its config.json?"
            )
        tensor = checkpoint.get(stored)
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(
                f"the checkpoint's {stored} has shape {tuple(tensor.shape)}, its config.json "
                f"gives {tuple(param.shape)}: the weights do not match the config"
            )
        reads.tensors, reads.bytes = reads.tensors + 1, reads.bytes + tensor.numel() * tensor.element_size()
        reads.names.append(stored)
        out = torch.empty(param.shape, dtype=torch.float32, device=device)
        out.copy_(tensor)
        del tensor  # one stored tensor alive at a time
        setattr(module, leaf, nn.Parameter(out, requires_grad=param.requires_grad))
    _refuse_meta(model)
    log.info("read %d tensors (%.1f MiB) of %s", reads.tensors, reads.bytes / 2**20, [f.name for f in files])
    return reads


def _refuse_meta(model: nn.Module) -> None:
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not left, f"still on the meta device after materialising: {left[:5]}"
