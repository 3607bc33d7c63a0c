from collections import namedtuple

import torch

from ddpkit.util.tree import map_tensors, tensors


def test_map_tensors_rebuilds_every_container_and_keeps_other_values():
    Pair = namedtuple("Pair", "a b")
    batch = {"x": torch.ones(2, 3), "meta": ["id", (torch.zeros(2), 7)], "pair": Pair(torch.ones(1), "s")}
    out = map_tensors(batch, lambda t: t[:0])
    assert (
        out["x"].shape == (0, 3)
        and out["meta"][0] == "id"
        and out["meta"][1][0].shape == (0,)
        and out["meta"][1][1] == 7
    )
    assert isinstance(out["meta"], list) and type(out["pair"]) is tuple and out["pair"][1] == "s"
    assert batch["x"].shape == (2, 3)  # the input is left as it was


def test_tensors_in_order_and_none_without_one():
    a, b, c = torch.tensor(1), torch.tensor(2), torch.tensor(3)
    assert [t.item() for t in tensors({"k": [a, {"z": b}], "m": (None, c)})] == [1, 2, 3]
    assert next(tensors({"s": "text", "n": [1, 2]}), None) is None
