"""A stage's tensors between host and device (pipeline/transfers.py). A bf16 hop reaches the worker
as bfloat16 (codec/checked.py's decode_received): the stage widens it to float32 on its device and
computes exactly what the float32 tensor would give. With a device codec (a GPU stage's blockwise
hops), results leave the worker encoded, as the transport would have encoded them."""

import pytest
import torch

from noloco_node.codec.blockwise import EncodedTensor
from noloco_node.codec.tensors import encode
from noloco_node.pipeline.transfers import Transfers
from noloco_node.pipeline.worker import NonFiniteValues

from .tiny_workers import HIDDEN, SEQ, tiny_worker


def received(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the bfloat16 tensor a receiver hands on, the float32 tensor it stands for)."""
    narrow = torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    return narrow, narrow.float()


def test_a_middle_stage_computes_the_same_forward_and_backward_from_bf16_inputs():
    narrow, wide = received(1)
    grad = torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    results = []
    for inputs in (narrow, wide):
        worker = tiny_worker(1, 3, batch_size=2, auto_step=False)
        output = worker.forward("mb", inputs)
        grad_input = worker.backward("mb", grad)
        results.append((output, grad_input, [p.grad.clone() for p in worker.stage.parameters()]))
    (out_a, gin_a, grads_a), (out_b, gin_b, grads_b) = results
    assert out_a.dtype == torch.float32 and gin_a.dtype == torch.float32
    assert torch.equal(out_a, out_b) and torch.equal(gin_a, gin_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


def test_the_last_stage_computes_the_same_loss_and_input_gradient_from_bf16_inputs():
    narrow, wide = received(3)
    labels = torch.randint(0, 32, (2, SEQ), generator=torch.Generator().manual_seed(4))
    workers = [tiny_worker(1, 2, batch_size=2, auto_step=False) for _ in range(2)]
    results = [worker.forward_backward_last(x, labels) for worker, x in zip(workers, (narrow, wide))]
    (grad_a, loss_a, tokens_a), (grad_b, loss_b, tokens_b) = results
    assert grad_a.dtype == torch.float32 and torch.equal(grad_a, grad_b)
    assert loss_a == loss_b and tokens_a == tokens_b == 2 * SEQ


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_a_bf16_hop_is_pinned_copied_and_widened_there():
    from noloco_node.model.stage import build_stage, llama_config
    from noloco_node.optim.inner import InnerOptimizer, InnerSchedule
    from noloco_node.pipeline.worker import StageWorker, WorkerSettings

    config = llama_config(
        vocab_size=32, hidden_size=HIDDEN, intermediate_size=32, num_layers=2, num_heads=2, max_seq_len=SEQ
    )
    narrow, wide = received(7)
    outputs = []
    for inputs in (narrow, wide):
        stage = build_stage(config, seed=0, stage_index=1, num_stages=2, device="cuda")
        inner = InnerOptimizer(stage.parameters(), InnerSchedule(lr_max=1e-2, warmup_steps=1, total_steps=10))
        worker = StageWorker(
            stage,
            inner,
            WorkerSettings(batch_size=2, saved_ttl_s=60, auto_step=False, device="cuda", bf16_autocast=True),
        )
        outputs.append(worker.forward_backward_last(inputs, torch.zeros(2, SEQ, dtype=torch.int64)))
    (grad_a, loss_a, _), (grad_b, loss_b, _) = outputs
    assert grad_a.device.type == "cpu" and torch.equal(grad_a, grad_b) and loss_a == loss_b


def test_results_encoded_where_they_were_computed_are_the_transports_own_encoding():
    inputs = torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(8))
    grad = torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(9))
    plain = tiny_worker(1, 3, batch_size=2, auto_step=False)
    encoding = tiny_worker(1, 3, batch_size=2, auto_step=False, device_codecs=("int8", "fp8"))
    for worker in (plain, encoding):
        worker.results = (worker.forward("mb", inputs), worker.backward("mb", grad))
    for direction, codec in ((0, "int8"), (1, "fp8")):
        got, tensor = encoding.results[direction], plain.results[direction]
        assert isinstance(got, EncodedTensor) and got.shape == tuple(tensor.shape)
        spec, payload = encode(tensor, codec, dtype="float32")
        assert got.spec == spec and bytes(got.payload_view()) == payload


def test_a_result_that_cannot_be_encoded_is_still_dropped_as_not_finite():
    worker = tiny_worker(1, 3, batch_size=2, auto_step=False, device_codecs=("int8", "int8"))
    bad = torch.full((2, SEQ, HIDDEN), float("nan"))
    with pytest.raises(NonFiniteValues):
        worker.forward("mb", bad)
    assert worker.dropped_non_finite == 1
    transfers = Transfers(torch.device("cpu"), (torch.float32, torch.float32), ("int8", "int8"))
    result, finite = transfers.to_host(torch.full((3,), 3e38), 0, check_finite=True).wait()
    assert finite and not isinstance(result, EncodedTensor)  # finite, beyond int8's range: the transport refuses it


@pytest.mark.parametrize(
    "device,activation,gradient,expected",
    [
        ("cuda", "int8", "int8", ("int8", "int8")),
        ("cuda", "int4", "int4", ("int4", None)),  # int4 gradients round stochastically in the transport
        ("cuda", "fp8", "bf16", ("fp8", None)),
        ("cuda", "bf16", "bf16", (None, None)),  # bf16 is a cast: the host copy of a bf16 tensor is the payload
        ("cpu", "int8", "int8", (None, None)),  # a CPU stage's host is its device: the transport encodes
    ],
)
def test_a_gpu_stage_encodes_its_blockwise_hops_on_its_device(device, activation, gradient, expected):
    from noloco_node.config import load_config
    from noloco_node.node.assembly import _worker_settings

    codecs = [f"pipeline.activation_codec={activation}", f"pipeline.gradient_codec={gradient}"]
    config = load_config(overrides=["pipeline.num_stages=2", *codecs])
    stage = tiny_worker(0, 2, batch_size=2, auto_step=False).stage
    settings = _worker_settings(config, stage, torch.device(device), auto_step=True)
    assert settings.device_codecs == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("codec", ["int8", "fp8", "int4"])
def test_on_a_gpu_the_device_encoding_is_the_hosts_byte_for_byte(codec):
    x = torch.randn(4, 1000, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    transfers = Transfers(torch.device("cuda"), (torch.float32, torch.float32), (codec, codec))
    result, finite = transfers.to_host(x.cuda(), 0, check_finite=True).wait()
    assert finite and isinstance(result, EncodedTensor) and result.payload.is_pinned()
    assert bytes(result.payload_view()) == encode(x, codec, dtype="float32")[1]


@pytest.mark.parametrize(
    "device,overlap,later",
    [("cuda", "true", True), ("cuda", "false", False), ("cpu", "false", True)],  # a CPU runs the same path
)
def test_a_gpu_stage_leaves_its_results_to_the_waiter_unless_the_config_says_wait(device, overlap, later):
    from noloco_node.config import load_config
    from noloco_node.node.assembly import _worker_settings

    config = load_config(overrides=["pipeline.num_stages=2", f"pipeline.overlap_result_copies={overlap}"])
    stage = tiny_worker(0, 2, batch_size=2, auto_step=False).stage
    assert _worker_settings(config, stage, torch.device(device), auto_step=True).results_later is later
