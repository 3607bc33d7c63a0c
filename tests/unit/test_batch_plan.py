"""The batch plan: the global batch of one optimizer step and how a world size cuts it."""

import pytest

from ddpkit.config import RunConfig
from ddpkit.errors import DdpkitError


def test_without_a_fixed_global_batch_it_grows_with_the_world():
    plan = RunConfig(batch_size=4, accumulate=2).batch_plan(3)
    assert (plan.global_batch, plan.accumulate, plan.fixed) == (24, 2, False)


@pytest.mark.parametrize(
    "world,batch,accumulate,shares",
    [(1, 4, 4, [16]), (2, 8, 1, [8, 8]), (3, 3, 2, [6, 5, 5]), (5, 4, 1, [4, 3, 3, 3, 3]), (16, 64, 1, [1] * 16)],
)
def test_a_fixed_global_batch_is_the_same_at_every_world_size(world, batch, accumulate, shares):
    plan = RunConfig(batch_size=batch, global_batch_size=16).batch_plan(world)
    assert (plan.global_batch, plan.accumulate) == (16, accumulate)
    assert [plan.share(r) for r in range(world)] == shares
    assert max(shares) <= batch * accumulate and sum(shares) == 16


def test_a_global_batch_smaller_than_the_world_is_refused_with_what_to_do():
    with pytest.raises(DdpkitError, match="smaller than the 4 processes.*--global-batch-size 4 or more"):
        RunConfig(global_batch_size=3, nproc=4)
    with pytest.raises(DdpkitError, match="drop --accumulate"):
        RunConfig(global_batch_size=8, accumulate=2)
    with pytest.raises(DdpkitError, match="--global-batch-size must be a positive integer"):
        RunConfig(global_batch_size=0)
