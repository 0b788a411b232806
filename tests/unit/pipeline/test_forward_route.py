"""A forward's route holds one hop per stage it passed (stage 0's, then each later one's), so a
forward to stage s has at most s. Found by a hostile-peer audit: only the last hop was checked, and
a 9,999-hop route (a ~0.9 MB header) was accepted, kept with the microbatch and sent on."""

import pytest

from noloco_node.codec.tensors import TensorSpec
from noloco_node.errors import InvalidPayload
from noloco_node.pipeline.ports import ForwardCall, Hop, MicrobatchKey
from noloco_node.pipeline.router import Bans, Router
from noloco_node.pipeline.runtime import StageRuntime
from noloco_node.pipeline.runtime_settings import RuntimeSettings, StageNetwork, StageShape


class Directory:
    def saw_address(self, peer_id: str, address: str) -> None:
        pass


def runtime(stage: int, num_stages: int) -> StageRuntime:
    network = StageNetwork(
        transport=None, directory=Directory(), router=Router(Bans()), me=Hop("QmMe", "127.0.0.1:2", stage)
    )
    shape = StageShape(stage=stage, num_stages=num_stages, boundary_width=4, seq_len=2, microbatch_size=1, vocab_size=8)
    return StageRuntime(
        shape=shape,
        worker=None,
        compute=None,
        network=network,
        settings=RuntimeSettings(max_in_flight=4, send_deadline_s=5.0),
    )


def admit(rt: StageRuntime, route: list[Hop], sequence: int = 0):
    call = ForwardCall(
        key=MicrobatchKey(origin="QmOrigin", sequence=sequence, attempt=0),
        target_stage=rt.shape.stage,
        route=tuple(route),
        labels=[1, 2],
    )
    return rt.admit_forward(call, TensorSpec(dtype="float32", shape=(1, 2, 4), codec="none"))


def route_to(stage: int, extra: int = 0) -> list[Hop]:
    earlier = [Hop(f"QmExtra{i}", "127.0.0.1:9", 0) for i in range(extra)]
    return earlier + [Hop(f"QmStage{s}", f"127.0.0.1:{10 + s}", s) for s in range(stage)]


@pytest.mark.parametrize("stage,num_stages", [(1, 2), (2, 3), (3, 4)])
def test_a_route_with_one_hop_per_earlier_stage_is_admitted(stage, num_stages):
    rt = runtime(stage, num_stages)
    assert admit(rt, route_to(stage)).route == route_to(stage)


@pytest.mark.parametrize("stage,num_stages,extra", [(1, 2, 1), (1, 2, 9998), (2, 3, 1), (3, 4, 5)])
def test_a_route_longer_than_the_stages_before_is_refused(stage, num_stages, extra):
    rt = runtime(stage, num_stages)
    with pytest.raises(InvalidPayload, match=rf"^route has {stage + extra} hops; a forward to stage {stage}"):
        admit(rt, route_to(stage, extra))
    assert not rt.in_flight  # nothing kept
