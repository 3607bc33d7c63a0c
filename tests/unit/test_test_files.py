"""pytest imports a test file outside a package by its basename (rootdir mode): two files of one
name in different folders stop the whole collection ("import file mismatch"), so the suite
would not run at all. Each test file's name is kept unique here, where it fails in a second."""

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _in_a_package(path: Path) -> bool:
    return (path.parent / "__init__.py").exists()


def test_no_two_test_files_outside_packages_share_a_name():
    seen: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        if not _in_a_package(path):
            seen[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"rename one of each: {clashes}"
