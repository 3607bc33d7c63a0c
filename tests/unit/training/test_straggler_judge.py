"""Naming a slow rank from every rank's (data, compute, wait, steps) sums."""

from ddpkit.training.stragglers import judge


def test_the_rank_busier_than_1_2x_the_median_is_named_with_where_its_time_goes():
    ranks = [[0.0, 1.0, 0.5, 10], [2.0, 1.0, 0.0, 10], [0.1, 1.0, 0.5, 10], [0.0, 1.1, 0.4, 10]]
    (found,) = judge(ranks, 1.2)
    assert found["rank"] == 1 and found["where"] == "data"
    assert found["ratio"] == round(0.3 / 0.11, 2)  # busy 0.3 s a step against the median 0.11


def test_equal_ranks_and_jitter_below_the_floor_name_no_one():
    assert judge([[0.0, 1.0, 0.0, 10]] * 4, 1.2) == []
    # 1.5x the median but only 1 ms a step slower: jitter, not a straggler
    assert judge([[0.0, 0.02, 0.0, 10], [0.0, 0.03, 0.0, 10], [0.0, 0.02, 0.0, 10]], 1.2) == []


def test_the_compute_bound_straggler_is_named_as_compute():
    (found,) = judge([[0.0, 1.0, 1.0, 4], [0.0, 3.0, 0.0, 4], [0.0, 1.0, 1.0, 4]], 1.2)
    assert (found["rank"], found["where"], found["ratio"]) == (1, "compute", 3.0)
