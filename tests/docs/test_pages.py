"""README.md and every page of docs/ but the guide (test_guide.py) cannot rot: each block is run
or read as its marker says (tests/docs/docblocks.py), in order, in one scratch folder per page.
Blocks depend on the ones before them on their page, so select them with -k only together."""

from __future__ import annotations

from pathlib import Path

import pytest
from docblocks import PAGES, check_block, parse_page, python_shims

BLOCKS = [b for page in PAGES if page.name != "guide.md" for b in parse_page(page.read_text(), page)]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """page -> (its scratch folder, the environment its blocks run in), made on first use."""
    made: dict[Path, tuple[Path, dict[str, str]]] = {}

    def get(page: Path) -> tuple[Path, dict[str, str]]:
        if page not in made:
            root = tmp_path_factory.mktemp(page.stem)
            made[page] = root, python_shims(root)
        return made[page]

    return get


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_page_block(block, scratch):
    root, env = scratch(block.page)
    check_block(block, root, env)
