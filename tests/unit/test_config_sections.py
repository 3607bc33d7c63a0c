"""RunConfig is the union of its sections (config/: one module each, with its settings and the
check of its own values); each component is handed its section alone, and a config file's
tables are the sections."""

import dataclasses

import pytest

from ddpkit import DdpkitError, RunConfig
from ddpkit.config import VALIDATIONS, Faults, Nodes, Output, Performance, Processes, Strategy, Training
from ddpkit.config.file import TABLES, table_name

SECTIONS = (Training, Processes, Faults, Nodes, Output, Strategy, Performance)


def test_every_setting_belongs_to_exactly_one_section_of_its_own_group():
    owners = {}
    for section in SECTIONS:
        for f in dataclasses.fields(section):
            assert f.metadata["group"] == section.GROUP, (section.__name__, f.name)
            assert f.name not in owners, (f.name, owners.get(f.name), section.__name__)
            owners[f.name] = section
    assert set(owners) == {f.name for f in dataclasses.fields(RunConfig)}
    assert set(VALIDATIONS) == {s.GROUP for s in SECTIONS}  # each section's check runs


def test_a_section_view_holds_its_settings_only_with_the_configs_values():
    cfg = RunConfig(keep_last=3, save_every_steps=7, run_dir="runs/x", tracker=["csv"], nproc=2)
    faults = cfg.faults
    assert type(faults) is Faults and faults.keep_last == 3 and faults.save_every_steps == 7
    assert not hasattr(faults, "run_dir") and not hasattr(faults, "nproc")
    assert (cfg.output.run_dir, cfg.output.tracker, cfg.processes.nproc) == ("runs/x", ["csv"], 2)
    assert cfg.nodes.node_range == (1, 1) and cfg.training.task == "wine"
    assert cfg.performance == Performance()


@pytest.mark.parametrize(
    "section, bad, message",
    [
        (Faults, {"keep_last": 0}, "--keep-last must be a positive integer"),
        (Processes, {"timeout": 0}, "--timeout must be a positive number"),
        (Nodes, {"nnodes": "2", "master_addr": "10.0.0.1"}, "needs --node-rank"),
        (Training, {"lr_schedule": "step"}, "--lr-schedule must be one of"),
        (Output, {"straggler_every": -1}, "--straggler-every must be 0 or"),
        (Strategy, {"precision": "fp8"}, "--precision must be one of"),
        (Performance, {"accumulate": 0}, "--accumulate must be a positive integer"),
        (Performance, {"peak_tflops": 0}, "--peak-tflops must be a positive number"),
    ],
)
def test_each_section_checks_its_own_values_without_the_rest(section, bad, message):
    section().check()
    with pytest.raises(DdpkitError, match=message):
        section(**bad).check()


def test_a_config_files_tables_are_the_sections():
    assert set(TABLES) == {table_name(s.GROUP) for s in SECTIONS}
    assert set(TABLES) == {"training", "processes", "faults", "nodes", "output", "strategy", "performance"}
