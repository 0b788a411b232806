"""A hop carries every element of its tensor: the outer exchange's sparse and sliced codecs are
refused on Forward and Backward. Found by a hostile-peer audit: a `CODEC_SLICE` activation with
`slice_parts = 2^32 - 1` (64 non-zero values of a whole microbatch) was accepted and trained on."""

import pytest

from noloco_node.codec.names import PIPELINE_CODECS, WIRE_CODECS
from noloco_node.codec.tensors import TensorSpec
from noloco_node.errors import InvalidPayload
from noloco_node.pipeline.call_checks import check_forward, check_gradient
from noloco_node.pipeline.ports import ForwardCall, Hop, MicrobatchKey
from noloco_node.pipeline.runtime_settings import StageShape

SHAPE = StageShape(stage=1, num_stages=2, boundary_width=4, seq_len=2, microbatch_size=1, vocab_size=8)
SPARSE = [codec for codec in WIRE_CODECS if codec not in PIPELINE_CODECS]


def forward(codec: str) -> tuple[ForwardCall, TensorSpec]:
    call = ForwardCall(
        key=MicrobatchKey(origin="QmOrigin", sequence=0, attempt=0),
        target_stage=1,
        route=(Hop("QmStage0", "127.0.0.1:10", 0),),
        labels=[1, 2],
    )
    return call, TensorSpec(dtype="float32", shape=(1, 2, 4), codec=codec)


def test_the_outer_exchanges_codecs_are_the_ones_left_out():
    assert set(SPARSE) == {"topk", "topk_int2", "topk_int4", "slice"}


@pytest.mark.parametrize("codec", PIPELINE_CODECS)
def test_every_hop_codec_is_taken(codec):
    assert check_forward(SHAPE, *forward(codec)) == (1, 2, 4)
    check_gradient(TensorSpec(dtype="float32", shape=(1, 2, 4), codec=codec), (1, 2, 4))


@pytest.mark.parametrize("codec", SPARSE)
def test_sparse_and_sliced_activations_are_refused(codec):
    with pytest.raises(InvalidPayload, match=rf"^activations in codec {codec}; a hop takes one of none, bf16"):
        check_forward(SHAPE, *forward(codec))


@pytest.mark.parametrize("codec", SPARSE)
def test_sparse_and_sliced_gradients_are_refused(codec):
    with pytest.raises(InvalidPayload, match=rf"^gradient in codec {codec}"):
        check_gradient(TensorSpec(dtype="float32", shape=(1, 2, 4), codec=codec), (1, 2, 4))


def test_what_the_last_stage_reports_must_be_a_loss_and_a_token_count():
    """A hostile-peer audit's Backward with loss NaN, 1e300-like infinities and num_tokens 2^64 - 1
    was answered OK; the loss is what stage 0 logs and publishes."""
    from noloco_node.pipeline.call_checks import check_reported

    check_reported(4.2, 2, (1, 2, 4))
    check_reported(0.0, 0, (1, 2, 4))
    for loss in (float("nan"), float("inf"), -1e30):
        with pytest.raises(InvalidPayload, match="is not a finite cross-entropy"):
            check_reported(loss, 2, (1, 2, 4))
    for tokens in (3, 2**64 - 1, -1):
        with pytest.raises(InvalidPayload, match=r"outside 0\.\.2"):
            check_reported(4.2, tokens, (1, 2, 4))
