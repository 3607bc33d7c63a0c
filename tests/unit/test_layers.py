"""Imports run one way only: each layer of ddpkit imports the layers below it, never above,
and no modules import each other in a cycle. Imports inside functions count too (a lazy
import upward is still an upward dependency), so this reads every import statement."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "ddpkit"

# Lowest first. A module may import its own layer and those before it.
LAYERS = [
    ["errors", "util"],  # util: the variables both sides read, the walk over nested batches and states,
    # small text files written whole or not at all
    ["storage"],  # where a run lives: a local folder or a bucket (fsspec), the commit by manifest
    ["parallel"],  # how a run is parallelised, without torch: the strategies' settings, rules, registry, footprints
    ["config"],  # RunConfig and its sections (one module each), flag values, --config FILE
    ["environments"],
    ["runtime"],
    ["checkpoint"],
    ["task", "tasks"],
    ["data"],
    ["strategies"],
    ["planning"],  # will it fit: the memory plan over the strategies
    ["reporting"],
    ["training"],
    ["launchers"],
    ["ownloop"],  # ddpkit.init() and its Session
    ["run"],  # a run's lifecycle: train() in the launcher, every worker, the notebook, the plan's request
    ["tools"],
    ["engines"],  # where the jobs run past one machine: SLURM, Ray, Kubernetes, SkyPilot, from one description
    ["cli", "__main__"],
]
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in SRC.rglob("*.py")}


def resolve(importer: str, is_package: bool, node: ast.AST) -> list[str]:
    """The ddpkit modules an import statement names (the most specific module that exists)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "ddpkit"]
    assert isinstance(node, ast.ImportFrom)
    if node.level == 0:
        if not (node.module or "").startswith("ddpkit"):
            return []
        base = node.module
    else:
        package = importer.split(".") if is_package else importer.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([node.module] if node.module else []))
    out = []
    for alias in node.names:
        candidate = f"{base}.{alias.name}"
        out.append(candidate if candidate in MODULES else base)
    return out


def imports_of(name: str) -> set[str]:
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update(resolve(name, path.name == "__init__.py", node))
    return found - {name}


GRAPH = {name: imports_of(name) for name in MODULES}


def layer(name: str) -> int | None:
    parts = name.split(".")
    return LAYER_OF.get(parts[1]) if len(parts) > 1 else None  # None: the package root (version, lazy names)


def test_every_module_has_a_layer():
    unplaced = [m for m in MODULES if m != "ddpkit" and layer(m) is None]
    assert not unplaced, f"add these to LAYERS: {unplaced}"


def test_imports_go_down_the_layers_only():
    upward = []
    for importer, targets in GRAPH.items():
        for target in targets:
            if importer == "ddpkit" or target == "ddpkit":
                continue  # the root holds only __version__ and names imported on first use
            if layer(target) > layer(importer):
                upward.append(f"{importer} -> {target}")
    assert not upward, "upward imports: " + ", ".join(sorted(upward))


def test_no_import_cycles():
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(GRAPH.get(m, ())):
            if t not in GRAPH or t == "ddpkit":
                continue
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t) :] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles: " + "; ".join(cycles)


def test_the_checker_sees_function_level_and_relative_imports():
    # a real edge of each kind, so a broken resolver cannot pass the tests above vacuously
    assert "ddpkit.checkpoint.sharded" in GRAPH["ddpkit.checkpoint.checkpointer"]  # inside a function
    assert "ddpkit.strategies.ddp_knobs" in GRAPH["ddpkit.strategies.ddp"]  # `from . import ddp_knobs`
    assert "ddpkit.runtime" in GRAPH["ddpkit.ownloop.session"]  # `from .runtime import Runtime` (a package)


def test_the_cli_and_config_import_no_torch():
    # `ddpkit --help` stays instant: the modules it loads must not import torch at module level
    cli = sorted(m for m in MODULES if m == "ddpkit.cli" or m.startswith("ddpkit.cli."))  # every command's module
    assert "ddpkit.cli.commands" in cli and "ddpkit.cli.train_cmd" in cli
    for name in (
        *cli,
        *sorted(m for m in MODULES if m.startswith("ddpkit.engines.")),
        *sorted(m for m in MODULES if m == "ddpkit.config" or m.startswith("ddpkit.config.")),
        "ddpkit.errors",
        "ddpkit.util.envvars",
        "ddpkit.parallel.spec",
    ):
        tree = ast.parse(MODULES[name].read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
        assert not any(n.split(".")[0] == "torch" for n in names), (name, names)
