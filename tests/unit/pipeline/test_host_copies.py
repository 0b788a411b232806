"""Results on their way from a GPU to the host (pipeline/host_copies.py): the copy is enqueued
without waiting on the device, arrives intact, and the device memory it reads is not reused before
it has. The CPU cases run everywhere; the CUDA cases in the device call (benchmarks/gpu_call.sh)."""

import pytest
import torch

from noloco_node.codec.blockwise import EncodedTensor
from noloco_node.model.stage import build_stage, llama_config
from noloco_node.optim.inner import InnerOptimizer, InnerSchedule
from noloco_node.pipeline.host_copies import Ready
from noloco_node.pipeline.transfers import Transfers
from noloco_node.pipeline.worker import NonFiniteValues, StageWorker, WorkerSettings

from .tiny_workers import HIDDEN, SEQ, VOCAB

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
HOLD_CYCLES = 200_000_000  # torch.cuda._sleep: ~0.1 s of a GPU's clock, the compute stream held busy


def test_a_cpu_result_is_ready_and_its_flag_is_read_when_it_is_waited_for():
    transfers = Transfers(torch.device("cpu"), (torch.float32, torch.float32), (None, None))
    good = transfers.to_host(torch.ones(3), 0, check_finite=True)
    bad = transfers.to_host(torch.tensor([1.0, float("inf")]), 0, check_finite=True)
    unchecked = transfers.to_host(torch.tensor([float("nan")]), 1, check_finite=False)
    assert all(isinstance(copy, Ready) for copy in (good, bad, unchecked))
    assert good.wait()[1] and not bad.wait()[1] and unchecked.wait()[1]


@needs_cuda
def test_a_copy_is_enqueued_without_waiting_for_the_kernels_before_it_and_arrives_intact():
    transfers = Transfers(torch.device("cuda"), (torch.bfloat16, torch.float32), (None, None))
    x = torch.randn(4, 256, 512, device="cuda")
    torch.cuda._sleep(HOLD_CYCLES)
    copy = transfers.to_host(x * 2, 0, check_finite=True)  # a temporary, dropped right here
    assert not copy.arrived  # the compute stream is still asleep: nothing waited for it
    value, finite = copy.wait()
    assert finite and value.is_pinned() and value.dtype == torch.bfloat16
    assert torch.equal(value, (x * 2).to(torch.bfloat16).cpu())


@needs_cuda
def test_the_device_memory_a_copy_reads_is_not_handed_out_again_before_it_has_read_it():
    transfers = Transfers(torch.device("cuda"), (torch.float32, torch.float32), (None, None))
    base = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    copies = []
    for i in range(8):
        torch.cuda._sleep(HOLD_CYCLES // 8)
        copies.append(transfers.to_host(base + i, 1, check_finite=False))
        # Same size, on the compute stream: would take the dropped temporary's block at once.
        torch.full((1 << 20,), -1.0, device="cuda").mul_(3)
    for i, copy in enumerate(copies):
        value, _ = copy.wait()
        assert torch.equal(value, (base + i).cpu()), f"copy {i} was overwritten"


@needs_cuda
def test_on_a_gpu_a_result_beyond_the_device_codecs_range_goes_plain_and_a_non_finite_one_is_flagged():
    transfers = Transfers(torch.device("cuda"), (torch.float32, torch.float32), ("int8", "int8"))
    fine = transfers.to_host(torch.randn(64, 64, device="cuda"), 0, check_finite=True).wait()
    huge = transfers.to_host(torch.full((64, 64), 3e38, device="cuda"), 0, check_finite=True).wait()
    nan = transfers.to_host(torch.full((64, 64), float("nan"), device="cuda"), 0, check_finite=True).wait()
    assert isinstance(fine[0], EncodedTensor) and fine[1]
    assert not isinstance(huge[0], EncodedTensor) and huge[1]  # finite: the transport decides, as on a CPU
    assert not nan[1]


@needs_cuda
def test_on_a_gpu_a_worker_leaving_its_results_later_gives_what_a_waiting_one_gives():
    inputs = torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(2))
    labels = torch.randint(0, 32, (2, SEQ), generator=torch.Generator().manual_seed(3))
    results = []
    for later in (False, True):
        workers = [_cuda_worker(stage, later) for stage in (1, 2)]
        outputs = [workers[0].forward("mb", inputs), workers[0].backward("mb", grad)]
        outputs.append(workers[1].forward_backward_last(inputs, labels))
        results.append([o.finish() if later else o for o in outputs])
    (out_a, gin_a, (g_a, loss_a, _)), (out_b, gin_b, (g_b, loss_b, _)) = results
    # Close, not equal: the same computation, but a GPU's attention backward may sum in another
    # order from run to run; a copy that read a stale or reused buffer would be far off.
    for a, b in ((out_a, out_b), (gin_a, gin_b), (g_a, g_b)):
        assert a.device.type == "cpu" and b.device.type == "cpu"
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert abs(loss_a - loss_b) <= 1e-5 * abs(loss_b) + 1e-6
    worker = _cuda_worker(1, True)
    with pytest.raises(NonFiniteValues):
        worker.forward("bad", torch.full((2, SEQ, HIDDEN), float("nan"))).finish()
    assert worker.dropped_non_finite == 1


def _cuda_worker(stage_index: int, later: bool) -> StageWorker:
    config = llama_config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_layers=3, num_heads=2, max_seq_len=SEQ
    )
    stage = build_stage(config, seed=0, stage_index=stage_index, num_stages=3, device="cuda")
    inner = InnerOptimizer(stage.parameters(), InnerSchedule(lr_max=1e-2, warmup_steps=1, total_steps=10))
    settings = WorkerSettings(batch_size=2, saved_ttl_s=60.0, auto_step=False, device="cuda", results_later=later)
    return StageWorker(stage, inner, settings)
