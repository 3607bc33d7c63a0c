"""Which node's link is slow: rank 0 times a send of PROBE_BYTES from every node, one node
after the other.

Why a probe: a slow link (a degraded network card, a congested port) slows every rank alike,
inside the gradient sync, where each rank only sees how long the collective took, not which
link it waited for. A timed send from one node to one other can tell links apart. Rank 0 times
each node's sending, one at a time so that no two probes share a link: its own node's (it sends
PROBE_BYTES to the next node's first rank, which answers with 4 bytes once it has them all),
then every other node's (it asks the node's first rank with 4 bytes and receives PROBE_BYTES
from it). A node whose probe takes clearly longer than the median node's is the one whose
sending is slow. Links are compared to each other and all meet at rank 0's node: a link slow
in both directions between the only two nodes slows both probes alike and names neither, and
a slow link into rank 0's node slows every other node's probe alike.

Cost: one send of PROBE_BYTES per node, in sequence (1 MiB: ~1 ms on a 10 Gbit/s link, so
~1 ms per node every --straggler-every steps), before the next step; the ranks that do not
probe go on and wait for the probing ones in the next step's gradient sync. The probe runs right
after the all-reduce that exchanges the window's figures (by then every rank has received every
gradient, so no gradient is still queued on a link).
"""

from __future__ import annotations

import time
from statistics import median

import torch
import torch.distributed as dist

from ..runtime import Runtime

PROBE_BYTES = 1 << 20
_DATA, _ANSWER, _ASK = 1, 2, 3  # message tags


def first_ranks(nodes: list[int]) -> list[int]:
    """The first rank of each node, in node order."""
    first: dict[int, int] = {}
    for rank, node in enumerate(nodes):
        first.setdefault(node, rank)
    return [first[n] for n in sorted(first)]


def probe(rt: Runtime, nodes: list[int]) -> dict[int, float]:
    """On rank 0: the seconds each node took to send PROBE_BYTES (node: seconds); {} on the
    other ranks and on a single node. Every rank calls it: it is recorded as one collective on
    every rank, so that the ranks' records stay aligned."""
    firsts = first_ranks(nodes)
    data = torch.zeros(PROBE_BYTES // 4, dtype=torch.float32, device=rt.device)
    token = torch.zeros(1, dtype=torch.float32, device=rt.device)
    with rt.collectives.record.track("link_probe", data, "backend"):
        others = [r for r in firsts if nodes[r] != nodes[0]]
        if not others:
            return {}
        if rt.rank == 0:
            return _time_every_node(data, token, others, nodes)
        if rt.rank == others[0]:  # receives rank 0's node's probe
            dist.recv(data, 0, tag=_DATA)
            data.sum().tolist()  # on a GPU: all of it has arrived before the answer leaves
            dist.send(token, 0, tag=_ANSWER)
        if rt.rank in others:
            dist.recv(token, 0, tag=_ASK)
            dist.send(data, 0, tag=_DATA)
        return {}


def _time_every_node(data: torch.Tensor, token: torch.Tensor, others: list[int], nodes: list[int]) -> dict:
    t0 = time.perf_counter()
    dist.send(data, others[0], tag=_DATA)
    dist.recv(token, others[0], tag=_ANSWER)
    token.tolist()  # on a GPU: wait until it has arrived
    seconds = {nodes[0]: time.perf_counter() - t0}
    for rank in others:
        t0 = time.perf_counter()
        dist.send(token, rank, tag=_ASK)
        dist.recv(data, rank, tag=_DATA)
        data.sum().tolist()
        seconds[nodes[rank]] = time.perf_counter() - t0
    return seconds


def judge_links(probe_s: dict[int, float], ranks_of: dict[int, list[int]], threshold: float, min_gap_s: float) -> list:
    """The nodes whose probe took more than `threshold` x the median node's (and the median by
    `min_gap_s`), each with its ranks, its rate and the other nodes' median rate (with 2 nodes
    the median of all is the mean, far below the fast node's rate). Nothing without a probe of
    every node."""
    if len(probe_s) < 2 or not all(s > 0 for s in probe_s.values()):
        return []
    typical = median(probe_s.values())
    return [
        {
            "node": node,
            "ranks": ranks_of[node],
            "ratio": round(s / typical, 2),
            "link_mb_per_s": round(PROBE_BYTES / s / 1e6, 2),
            "others_mb_per_s": round(PROBE_BYTES / median([t for n, t in probe_s.items() if n != node]) / 1e6, 2),
        }
        for node, s in sorted(probe_s.items())
        if s > threshold * typical and s - typical > min_gap_s
    ]
