"""The start-up's parts (training/ledger.py): each from the clock at its end, a missing clock's
time given to the next part, the parts summing to the start-up."""

from ddpkit.training.ledger import STARTUP_PARTS, startup_parts


def test_the_startup_parts_sum_to_the_startup_and_a_missing_clock_goes_to_the_next_part():
    marks = {"launcher": 2.0, "spawn": None, "imports": 2.5, "process_group": 3.0, "task": 4.5}
    parts = startup_parts(1.0, marks, 5.0)
    assert list(parts) == list(STARTUP_PARTS)
    assert parts == {"launcher": 1.0, "spawn": 0.0, "imports": 0.5, "process_group": 0.5, "task": 1.5, "setup": 0.5}
    assert abs(sum(parts.values()) - 4.0) < 1e-9
