"""The size of ddpkit's code: no module in src/ddpkit over MAX_MODULE_LINES lines, and no
function over MAX_LINES lines (decorators, signature and docstring included) unless its
docstring says why it is best whole, in a sentence that starts with MARKER ("Long: ..."); even
then none over HARD_MAX_LINES. A long function is usually several steps that each deserve a
name; a long module, several concerns that each deserve a module."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "ddpkit"
MAX_LINES = 60
HARD_MAX_LINES = 80
MAX_MODULE_LINES = 500
MARKER = "Long:"

# (file under src/ddpkit, function): exempt by name, only there (none today: say why in the docstring)
EXEMPT: set[tuple[str, str]] = set()


def long_functions(source: str, max_lines: int = MAX_LINES) -> list[tuple[str, int, int, str]]:
    """(name, first line, length in lines, docstring) of every function in `source` (methods and
    nested functions included) over `max_lines` lines, counted from its first decorator."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            length = node.end_lineno - first + 1
            if length > max_lines:
                found.append((node.name, node.lineno, length, ast.get_docstring(node) or ""))
    return found


def modules() -> list[tuple[str, str]]:
    return [(path.relative_to(SRC).as_posix(), path.read_text()) for path in sorted(SRC.rglob("*.py"))]


def test_no_function_is_long_without_a_reason():
    unexplained = []
    for rel, source in modules():
        for name, line, length, doc in long_functions(source):
            if MARKER not in doc and (rel, name) not in EXEMPT:
                unexplained.append(f"src/ddpkit/{rel}:{line} {name} ({length} lines)")
    assert not unexplained, (
        f"functions over {MAX_LINES} lines: split them, or say in the docstring why one is best whole "
        f"('{MARKER} ...'):\n  " + "\n  ".join(unexplained)
    )


def test_no_function_is_over_the_hard_limit_whatever_its_reason():
    too_long = [
        f"src/ddpkit/{rel}:{line} {name} ({length} lines)"
        for rel, source in modules()
        for name, line, length, _ in long_functions(source, HARD_MAX_LINES)
    ]
    assert not too_long, f"functions over {HARD_MAX_LINES} lines: split them by concern:\n  " + "\n  ".join(too_long)


def test_no_module_is_over_the_limit():
    too_long = [
        f"src/ddpkit/{rel} ({n} lines)"
        for rel, source in modules()
        if (n := len(source.splitlines())) > MAX_MODULE_LINES
    ]
    assert not too_long, (
        f"modules over {MAX_MODULE_LINES} lines: split them by concern, inside their package:\n  "
        + "\n  ".join(too_long)
    )


def test_the_walk_finds_a_long_method_and_reads_its_reason():
    # so that a broken walk cannot pass the tests above vacuously
    body = "        x = 1\n" * 3
    short = "class A:\n    @staticmethod\n    def f():\n" + body
    assert long_functions(short, max_lines=5) == []
    reason = '        """Long: one table."""\n'
    found = long_functions("class A:\n    @staticmethod\n    def f():\n" + reason + body, max_lines=5)
    assert found == [("f", 3, 6, "Long: one table.")]
    sizes = {rel: len(source.splitlines()) for rel, source in modules()}
    assert "planning/memory.py" in sizes and max(sizes.values()) > 100  # the module walk reads real files


ROOT = SRC.parents[1]
TOOLS = ("scripts", "benchmarks", "examples")  # the project's programs beside the package
MAX_BASH_LINES = 150  # past that, a script is a program: write it in Python


def test_the_scripts_and_benchmarks_keep_the_hard_limits_too():
    over = []
    for folder in TOOLS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            source, rel = path.read_text(), path.relative_to(ROOT).as_posix()
            if (n := len(source.splitlines())) > MAX_MODULE_LINES:
                over.append(f"{rel} ({n} lines)")
            over += [f"{rel}:{line} {name} ({length} lines)" for name, line, length, _ in long_functions(source, 80)]
    assert not over, "split these by concern:\n  " + "\n  ".join(over)
    assert len(list((ROOT / "scripts").glob("*.py"))) > 3 and len(list((ROOT / "benchmarks").glob("*.py"))) > 3


def test_no_bash_script_is_a_program():
    long = [
        f"{p.relative_to(ROOT)} ({n} lines)"
        for p in sorted(ROOT.glob("**/*.sh"))
        if not any(part.startswith(".venv") for part in p.parts)
        and (n := len(p.read_text().splitlines())) > MAX_BASH_LINES
    ]
    assert not long, f"bash scripts over {MAX_BASH_LINES} lines: write them in Python:\n  " + "\n  ".join(long)
