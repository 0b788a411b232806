"""sync.ports.MethodTraits: each method's traits, given by the factory before the sync is built,
are the ones its OuterSync carries; nothing outside sync/ names a method."""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from noloco_node.sync.diloco import DiLoCoSync
from noloco_node.sync.dp import EXTRA_SHAPE, DataParallelSync
from noloco_node.sync.factory import method_traits
from noloco_node.sync.noloco import NoLoCoSync
from noloco_node.sync.ports import NoSync

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    "method, cls", [("noloco", NoLoCoSync), ("diloco", DiLoCoSync), ("dp", DataParallelSync), ("none", NoSync)]
)
def test_the_factory_gives_the_traits_the_method_carries(method, cls):
    traits = method_traits(method)
    assert traits is cls.traits and traits.name == method
    assert traits.syncs == (method != "none")
    assert traits.outer_rounds == (method in ("noloco", "diloco"))
    assert traits.takes_inner_step == traits.lockstep == (method == "dp")
    assert traits.balanced_routing == traits.all_reduce == (method in ("diloco", "dp"))
    assert traits.donates_state == traits.movable == (method == "noloco")


def test_all_reduce_shapes_per_method():
    w, b = torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(4))
    worker = SimpleNamespace(stage=torch.nn.ParameterList([w, b]), inner=SimpleNamespace(params=[w, b]))
    assert method_traits("diloco").all_reduce_shapes(worker) == [w.shape, b.shape]
    assert method_traits("dp").all_reduce_shapes(worker) == [w.shape, b.shape, EXTRA_SHAPE]
    assert method_traits("noloco").all_reduce_shapes is None


def test_start_at_is_a_no_op_where_a_method_counts_no_rounds_of_its_own():
    sync = NoSync()
    sync.start_at(7)
    assert sync.outer_round == 0 and sync.method == "none"


def test_no_module_outside_sync_compares_the_method():
    compare = re.compile(r"\.method (==|!=|in) ")
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for package in ("node", "pipeline", "rpc")
        for path in (ROOT / "noloco_node" / package).rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if compare.search(line)
    ]
    assert found == [], found
    assert not re.search(r"getattr\(self\.sync", (ROOT / "noloco_node/node/lifecycle.py").read_text())
