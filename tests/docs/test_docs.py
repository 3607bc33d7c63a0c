"""The documentation as a whole, read without running anything: every block of every page is
checked by something, every flag a page names exists, every link and anchor of README.md and
docs/ resolves (with GitHub's anchors, which the site uses too), every page is in the site's
nav, and the API and CLI references cover what they document. The site itself is built in
strict mode by `make docs` (part of `make test`)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import yaml
from docblocks import (
    KINDS,
    PAGES,
    REPO,
    command_problems,
    commands,
    ddpkit_problems,
    extras_named,
    fragment_problems,
    inline_problems,
    layout_names,
    parse_page,
    prose,
    span_problems,
    with_dry_run,
)

DOCS = REPO / "docs"
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def page_id(page: Path) -> str:
    return str(page.relative_to(REPO))


def hooks():
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", REPO / "scripts" / "mkdocs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- the checks themselves can fail ----


def test_a_block_nothing_checks_is_unchecked():
    page = REPO / "docs" / "x.md"
    blocks = parse_page("```text\nhello\n```\n\n<!-- output -->\n```text\nhi\n```\n\n```bash\nls\n```\n", page)
    assert [b.kind for b in blocks] == ["unchecked", "output", "run"]
    python = parse_page("```python\nx = 1\n```\n", page)
    assert python[0].kind == "unchecked"


def test_a_flag_a_value_or_a_task_the_cli_lacks_is_named():
    assert ddpkit_problems(["train", "wine", "--nproc", "2"], REPO) == []
    assert "unrecognized arguments: --no-such-flag" in ddpkit_problems(["train", "--no-such-flag"], REPO)[0]
    assert "invalid choice: 'zero'" in ddpkit_problems(["train", "--strategy", "zero"], REPO)[0]
    assert ddpkit_problems(["train", "examples/gpt.py:nothing"], REPO) == [
        "task examples/gpt.py:nothing: examples/gpt.py defines no nothing"
    ]
    assert ddpkit_problems(["train", "missing.py:build"], REPO) == ["task missing.py:build: no file missing.py"]
    # a SLURM job's training arguments are train's
    assert "--no-such-flag" in ddpkit_problems(["slurm", "--nodes", "2", "--", "wine", "--no-such-flag"], REPO)[0]


def test_make_pip_python_and_torchrun_lines_are_read():
    def problems(text: str) -> list[str]:
        return [p for words in commands(text) for p in command_problems(words, REPO, True)]

    assert problems("make train ARGS='--nproc 4 --epochs 20'\nmake test  # the suite\n") == []
    assert "no target nothing" in problems("make nothing")[0]
    assert "no variable NOPE" in problems("make test NOPE=1")[0]
    assert "unrecognized arguments: --no-such" in problems("make train ARGS='--no-such'")[0]
    assert problems("pip install 'ddpkit[mlflow]'") == []
    assert "no extra nope" in problems("pip install 'ddpkit[nope]'")[0]
    assert problems("python benchmarks/run.py --quick") == []
    assert "has no flag --no-such" in problems("python benchmarks/run.py --no-such")[0]
    assert problems("torchrun --standalone --nproc-per-node 2 -m ddpkit train --epochs 20 | tail -3") == []
    assert "--no-such" in problems("torchrun --nproc-per-node 2 -m ddpkit train --no-such")[0]
    assert "nothing checks a `sbatch` command" in problems("sbatch job.sbatch")[0]


def test_dry_run_goes_before_the_training_arguments():
    assert with_dry_run("ddpkit train --nnodes 2  # on node 0\n") == "ddpkit train --nnodes 2 --dry-run  # on node 0\n"
    assert (
        with_dry_run("ddpkit slurm --nodes 2 -- wine --epochs 3\n")
        == "ddpkit slurm --nodes 2 --dry-run -- wine --epochs 3\n"
    )


def test_a_fragment_that_uses_what_does_not_exist_is_named():
    assert fragment_problems("rt = ddpkit.init()\nmodel = rt.wrap(model, strategy='fsdp')\n") == []
    assert fragment_problems("ddpkit.no_such()") == ["ddpkit.no_such does not exist"]
    assert fragment_problems("rt.no_such") == ["rt.no_such: a Session has no no_such"]
    assert fragment_problems("rt.clip_grad_norm(model, max_nrm=1.0)") == [
        "rt.clip_grad_norm(max_nrm=...): no such parameter"
    ]
    assert fragment_problems("ddpkit.Task(model=m, train_set=d, optimizr=o)") == [
        "ddpkit.Task(optimizr=...): no such parameter"
    ]


def test_inline_flags_and_values_are_checked():
    assert span_problems("--nproc N|auto", REPO) == []
    assert span_problems("--strategy ddp|fsdp|hsdp|auto", REPO) == []
    assert span_problems("--strategy ddp|zero", REPO) == ["--strategy zero: not one of ddp, fsdp, hsdp, auto"]
    assert span_problems("--no-such-flag", REPO) == ["no ddpkit command has --no-such-flag"]
    assert span_problems("ddpkit export --format hf", REPO) == []
    assert span_problems("ddpkit plot --format hf", REPO) == ["ddpkit plot has no --format"]
    assert extras_named("pip install 'ddpkit[mlflow,nope]'") == (["mlflow", "nope"], ["nope"])
    assert span_problems("ddpkit.reporting.plot.plot_curves", REPO) == []
    assert span_problems("ddpkit.plot.plot_curves", REPO) == ["ddpkit.plot.plot_curves: no plot in ddpkit"]
    assert span_problems('ddpkit.load_config("wine.toml", epochs=30)', REPO) == []
    assert span_problems("rt.wrap(..., activation_checkpointing=True)", REPO) == []
    assert span_problems("rt.clip_grad_norm(model, max_nrm=1)", REPO) == [
        "rt.clip_grad_norm(max_nrm=...): no such parameter"
    ]


# ---- every page ----


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_block_is_checked(page):
    unchecked = [b.where for b in parse_page(page.read_text(), page) if b.kind == "unchecked"]
    assert not unchecked, f"blocks nothing checks (mark them: tests/docs/docblocks.py): {unchecked}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_flag_a_page_names_exists(page):
    problems = inline_problems(page.read_text(), REPO)
    assert not problems, "\n".join(problems)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading (mkdocs.yml makes the site's the same)."""
    from pymdownx.slugs import slugify

    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    return slugify(case="lower")(text, "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    for _, line in prose(page.read_text()):
        m = re.match(r"^(#{1,6}) (.+?)\s*#*$", line)
        if m:
            s = slug(m.group(2))
            assert s not in found, (
                f"{page_id(page)}: two headings make the anchor #{s} (GitHub and the site differ then)"
            )
            found.add(s)
    return found


@pytest.mark.parametrize("page", [*PAGES, REPO / "CONTRIBUTING.md"], ids=page_id)
def test_links_and_anchors_resolve(page):
    """Relative links and #anchors, as GitHub resolves them (the site resolves the same ones:
    mkdocs build --strict checks it there). README.md links only into docs/ and its own
    anchors, so that its copy on the site (the home page) works."""
    problems = []
    for n, line in prose(page.read_text()):
        for m in LINK.finditer(line):
            target = m.group(1) or m.group(2)
            if re.match(r"^[a-z]+:", target):
                continue  # http(s), mailto: not followed offline
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                problems.append(
                    f"line {n}: {target}: no {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}"
                )
                continue
            if page.name == "README.md" and path and not dest.is_relative_to(DOCS):
                problems.append(f"line {n}: {target}: the README links into docs/ only (it is the site's home page)")
            if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"line {n}: {target}: no heading #{anchor} in {dest.name}")
    assert not problems, "\n".join(problems)


def nav_pages(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [p for v in nav.values() for p in nav_pages(v)]
    return [p for item in nav for p in nav_pages(item)]


def test_every_page_is_in_the_nav():
    text = (REPO / "mkdocs.yml").read_text()
    nav = yaml.safe_load(text[text.index("\nnav:") :])["nav"]  # the rest holds a python tag safe_load refuses
    listed = nav_pages(nav)
    pages = sorted(p.name for p in DOCS.glob("*.md"))
    assert sorted(set(listed) - {"index.md"}) == pages
    assert len(listed) == len(set(listed))


def test_the_api_reference_covers_the_public_api():
    import ddpkit

    text = (DOCS / "api.md").read_text()
    documented = {line.split()[-1].rsplit(".", 1)[-1] for line in text.splitlines() if line.startswith("::: ")}
    assert sorted(set(ddpkit.__all__) - documented) == []


def test_the_cli_reference_has_every_command_and_flag():
    from docblocks import cli

    reference = hooks().cli_reference()
    for name, parser in cli().items():
        assert f"### ddpkit {name}\n" in reference
        section = reference.split(f"### ddpkit {name}\n")[1].split("### ddpkit ")[0]
        for action in parser._actions:
            for option in action.option_strings:
                assert re.search(rf"`{re.escape(option)}[ `]", section), f"ddpkit {name} {option}"
    assert "<!-- cli-reference -->" in (DOCS / "cli.md").read_text()


def test_the_readme_is_the_site_home_page_with_its_links():
    site = hooks().readme_for_site((REPO / "README.md").read_text())
    assert "](docs/" not in site
    assert "](guide.md" in site


def test_the_layout_names_are_read():
    assert layout_names("task.py, tasks/        what the user supplies\n                       more\ncli/    x\n") == [
        "task.py",
        "tasks/",
        "cli/",
    ]


def test_block_markers_are_known():
    """A misspelt marker would leave its block unmarked (or the test of a page checking less)."""
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            m = re.match(r"\s*<!-- ([\w-]+)(?::.*)? -->\s*$", line)
            if m:
                assert m.group(1) in (*KINDS, "cli-reference"), f"{page_id(page)} line {n}: unknown marker {m.group(1)}"
