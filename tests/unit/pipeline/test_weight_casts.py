"""bf16 autocast with the matmul weights cast once per weight version (pipeline/weight_casts.py):
the stage computes the same outputs and gradients, bit for bit, as autocast casting them for every
microbatch, with one cast per weight and version instead of one per forward. Run on the CPU's bf16
autocast, and on a GPU where there is one (there attention's backward kernels need not be
deterministic: equal within float tolerance); the node turns autocast on for a GPU only."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from noloco_node.model.stage import build_stage, llama_config
from noloco_node.optim.inner import InnerOptimizer, InnerSchedule
from noloco_node.pipeline.weight_casts import matmul_weight_names
from noloco_node.pipeline.worker import StageWorker, WorkerSettings

HIDDEN, SEQ, VOCAB, MICROBATCHES = 16, 8, 32, 4
CONFIG = llama_config(
    vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_layers=3, num_heads=2, max_seq_len=SEQ
)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def autocast(device: str):
    return torch.autocast(device, dtype=torch.bfloat16)


def same(actual: torch.Tensor, expected: torch.Tensor, device: str, what: str = "") -> None:
    """Bit for bit on the CPU; on a GPU within float tolerance (module docstring)."""
    actual, expected = actual.detach().float().cpu(), expected.detach().float().cpu()
    if device == "cpu":
        assert torch.equal(actual, expected), what
    else:
        torch.testing.assert_close(actual, expected, msg=what)


def stage(index: int, device: str = "cpu"):
    return build_stage(CONFIG, seed=0, stage_index=index, num_stages=3, device=device)


def worker(index: int, device: str = "cpu", *, stash: bool = False) -> StageWorker:
    s = stage(index, device)
    inner = InnerOptimizer(s.parameters(), InnerSchedule(lr_max=1e-2, warmup_steps=1, total_steps=10))
    settings = WorkerSettings(
        batch_size=2 * MICROBATCHES,
        saved_ttl_s=60,
        auto_step=False,
        device=device,
        bf16_autocast=True,
        stash_weights=stash,
    )
    return StageWorker(s, inner, settings)


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def hidden(seed: int) -> torch.Tensor:
    return torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(seed))


def grads(module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


class WeightCastCounter(TorchDispatchMode):
    """Counts fp32 -> bf16 copies made of the given tensors."""

    def __init__(self, tensors):
        super().__init__()
        self.pointers = {t.data_ptr() for t in tensors}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16:
            self.count += args[0].data_ptr() in self.pointers
        return func(*args, **kwargs)


def test_the_casts_are_every_linear_weight_and_nothing_else():
    names = matmul_weight_names(stage(0))
    assert "model.layers.0.self_attn.q_proj.weight" in names and "model.layers.0.mlp.down_proj.weight" in names
    assert not any("norm" in n or "embed" in n for n in names)
    assert "lm_head.weight" in matmul_weight_names(stage(2))
    assert len(matmul_weight_names(stage(1))) == 7  # q, k, v, o, gate, up, down of its one layer


@pytest.mark.parametrize("device", DEVICES)
def test_first_stage_graphs_share_one_cast_and_match_autocast(device):
    w, reference = worker(0, device), stage(0, device)
    counter = WeightCastCounter([w.params[n] for n in matmul_weight_names(w.stage)])
    outputs = []
    with counter:
        for i in range(MICROBATCHES):  # a batch's graphs all alive at once, as stage 0 keeps them
            outputs.append(w.forward(i, tokens(i), keep_graph=True))
        for i in range(MICROBATCHES):
            w.backward(i, hidden(10 + i))
    assert counter.count == len(matmul_weight_names(w.stage))  # once per weight, not once per microbatch
    for i in range(MICROBATCHES):
        with autocast(device):
            expected = reference(tokens(i).to(device))
        expected.backward(hidden(10 + i).to(device, expected.dtype))
        same(outputs[i], expected, device, f"output {i}")
    assert grads(w.stage).keys() == grads(reference).keys()
    for name, grad in grads(reference).items():
        same(w.params[name].grad, grad, device, name)


@pytest.mark.parametrize("device", DEVICES)
def test_a_recomputing_middle_stage_matches_autocast(device):
    w, reference = worker(1, device), stage(1, device)
    counter = WeightCastCounter([w.params[n] for n in matmul_weight_names(w.stage)])
    with counter:
        for i in range(MICROBATCHES):
            w.forward(i, hidden(i))  # no graph: the backward recomputes it
        input_grads = [w.backward(i, hidden(10 + i)) for i in range(MICROBATCHES)]
    assert counter.count == len(matmul_weight_names(w.stage))
    for i in range(MICROBATCHES):
        x = hidden(i).to(device).requires_grad_()
        with autocast(device):
            out = reference(x)
        out.backward(hidden(10 + i).to(device, out.dtype))
        same(input_grads[i], x.grad, device, f"input gradient {i}")
    for name, grad in grads(reference).items():
        same(w.params[name].grad, grad, device, name)


@pytest.mark.parametrize("device", DEVICES)
def test_the_last_stage_recasts_after_a_step_and_matches_autocast(device):
    w, reference = worker(2, device), stage(2, device)
    ref_inner = InnerOptimizer(reference.parameters(), InnerSchedule(lr_max=1e-2, warmup_steps=1, total_steps=10))
    labels = tokens(99)
    counter = WeightCastCounter([w.params[n] for n in matmul_weight_names(w.stage)])
    with counter:
        for step in range(2):
            for i in range(MICROBATCHES):
                grad_in, loss, _ = w.forward_backward_last(hidden(i + step), labels)
                x = hidden(i + step).to(device).requires_grad_()
                with autocast(device):
                    ref_loss = reference(x, labels=labels.to(device))
                (ref_loss * (2 / w.batch_size)).backward()
                same(torch.tensor(loss), ref_loss, device, "loss")
                same(grad_in, x.grad, device, f"input gradient {i}")
            w.step()
            ref_inner.step()
    assert counter.count == 2 * len(matmul_weight_names(w.stage))  # one cast per weight version
    for name, p in reference.named_parameters():
        same(w.params[name], p, device, name)


@pytest.mark.parametrize("device", DEVICES)
def test_the_overlap_schedules_stash_runs_on_its_own_casts(device):
    """Stage 0 with and without the weight stash, both under autocast: the same weights after a
    step (the stash's gradients land on its copies, through their casts, and join at the step)."""
    workers = {s: worker(0, device, stash=s) for s in (False, True)}
    for w in workers.values():
        for i in range(MICROBATCHES):
            w.forward(i, tokens(i), keep_graph=True)
        for i in range(MICROBATCHES):
            w.backward(i, hidden(10 + i))
        w.step()
    assert workers[True]._stash[1].run_on["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
    for name, p in workers[False].params.items():
        same(workers[True].params[name], p, device, name)


def test_without_autocast_the_stage_runs_on_its_own_parameters():
    s = stage(1)
    inner = InnerOptimizer(s.parameters(), InnerSchedule(lr_max=1e-2, warmup_steps=1, total_steps=10))
    w = StageWorker(s, inner, WorkerSettings(batch_size=2, saved_ttl_s=60, auto_step=False))
    assert w.casts.current(w.params) is None
    out = w.forward("a", hidden(0))
    assert out.dtype == torch.float32 and torch.equal(out, s(hidden(0)).detach())


def test_weights_changed_in_place_outside_a_step_are_cast_again():
    """The outer step, a repair or a loaded state change the parameters in place between inner
    steps: the next forward runs on the new values, never on a stale cast."""
    w, reference = worker(1), stage(1)
    w.forward("before", hidden(0))
    with torch.no_grad():
        for p in list(w.params.values()) + list(reference.parameters()):
            p.mul_(0.5)  # as an outer step's in-place update
    out = w.forward("after", hidden(0))
    with torch.no_grad(), autocast("cpu"):
        expected = reference(hidden(0))
    same(out, expected, "cpu")
