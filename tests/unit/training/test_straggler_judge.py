"""Naming a slow rank from every rank's (data, compute, wait, steps) sums, and a slow node from
the probes of the nodes' links."""

from ddpkit.training.links import PROBE_BYTES, first_ranks, judge_links
from ddpkit.training.stragglers import findings, judge


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


def test_the_node_whose_link_probe_is_slow_is_named_with_its_ranks():
    assert first_ranks([0, 0, 1, 1, 2, 2]) == [0, 2, 4]
    ranks_of = {0: [0, 1], 1: [2, 3], 2: [4, 5]}
    (found,) = judge_links({0: 0.001, 1: 0.3, 2: 0.0012}, ranks_of, 1.2, 0.002)
    assert (found["node"], found["ranks"], found["ratio"]) == (1, [2, 3], 250.0)
    assert found["link_mb_per_s"] == round(PROBE_BYTES / 0.3 / 1e6, 2)
    assert found["others_mb_per_s"] == round(PROBE_BYTES / 0.0011 / 1e6, 2)  # nodes 0 and 2


def test_links_alike_jitter_below_the_floor_or_a_missing_probe_name_no_node():
    ranks_of = {0: [0], 1: [1], 2: [2]}
    assert judge_links({0: 0.1, 1: 0.1, 2: 0.11}, ranks_of, 1.2, 0.002) == []
    assert judge_links({0: 0.001, 1: 0.0025, 2: 0.001}, ranks_of, 1.2, 0.002) == []  # 2.5x, 1.5 ms: jitter
    assert judge_links({0: 0.001, 1: 0.3}, {0: [0], 1: [1]}, 1.2, 0.002)[0]["node"] == 1  # 2 nodes: the mean
    assert judge_links({0: 0.3}, {0: [0, 1]}, 1.2, 0.002) == []


def test_while_a_link_is_slow_no_rank_is_named_for_its_compute_only_for_its_data():
    # (data, compute, wait, steps, node): rank 0 waits for node 1's link inside its compute,
    # rank 2 is slow to load its data
    ranks = [[0.0, 3.0, 0.0, 10, 0], [0.0, 1.0, 2.0, 10, 1], [4.0, 1.0, 0.0, 10, 1], [0.0, 1.0, 2.0, 10, 1]]
    named = [(f["rank"], f["where"]) for f in findings(ranks, {0: 0.001, 1: 0.3}, 1.2)]
    assert named == [(2, "data"), (1, "link"), (2, "link"), (3, "link")]
    assert [(f["rank"], f["where"]) for f in findings(ranks, {}, 1.2)] == [(0, "compute"), (2, "data")]
