"""Before `ddpkit slurm --submit`, the job is held against what `sinfo` says of the cluster
(engines/sbatch.py: parse_sinfo, check_against): a job the cluster could never run is refused
in one line, where sbatch would queue some of them for ever."""

import pytest

from ddpkit.engines.sbatch import Partition, SlurmJob, check_against, parse_sinfo

SINFO = """\
debug*|2|1:00:00|up
debug*|1|1:00:00|up
gpu|8|2-00:00:00|up
long|4|infinite|up
old|2|30:00|down
"""


def test_sinfo_lines_are_read_per_partition():
    known = {p.name: p for p in parse_sinfo(SINFO + "garbage line\n")}
    assert known["debug"] == Partition("debug", 3, 3600, True, default=True)  # its lines summed, the '*' read
    assert known["gpu"].time_limit_s == 2 * 86400 and known["long"].time_limit_s is None
    assert known["old"] == Partition("old", 2, 1800, False)


def job(**kw):
    return SlurmJob(train_args=["wine"], **kw)


@pytest.mark.parametrize(
    "kw, said",
    [
        ({"partition": "nope"}, "--partition nope: this cluster has no such partition (it has: debug, gpu, long, old)"),
        ({"partition": "old"}, "partition old is not up"),
        ({"nodes": 4}, "--nodes 4: partition debug has 3 node(s)"),  # the default partition
        ({"nodes": 9, "partition": "gpu"}, "--nodes 9: partition gpu has 8 node(s)"),
        ({"time": "02:00:00"}, "--time 02:00:00: partition debug allows at most 01:00:00"),
        ({"time": "3-00:00:00", "partition": "gpu"}, "partition gpu allows at most 2-00:00:00"),
    ],
)
def test_a_job_the_cluster_cannot_run_is_named_in_one_line(kw, said):
    problem = check_against(job(**kw), parse_sinfo(SINFO))
    assert problem is not None and said in problem and "\n" not in problem


@pytest.mark.parametrize(
    "kw",
    [{}, {"nodes": 3, "time": "59"}, {"partition": "long", "nodes": 4, "time": "30-00:00:00"}, {"partition": "gpu"}],
)
def test_a_job_that_fits_passes(kw):
    assert check_against(job(**kw), parse_sinfo(SINFO)) is None


def test_without_sinfo_nothing_is_refused():
    assert check_against(job(partition="any", nodes=99), None) is None
    assert check_against(job(nodes=99), parse_sinfo("long|4|infinite|up\n")) is None  # no default: sbatch decides
