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
