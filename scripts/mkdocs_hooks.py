"""MkDocs hooks (mkdocs.yml: hooks): what the site takes from the repository at build time.

- The home page is README.md itself, its links into docs/ made relative to the site, so the
  README is written once and its links work on GitHub and on the site alike.
- docs/cli.md's `<!-- cli-reference -->` line becomes the reference of every command and
  flag, made from the CLI's own parser: the declarations are the only source, so the page
  cannot fall behind them (`python scripts/mkdocs_hooks.py` prints it).
- A page's link to ../README.md is a link to the home page.
- A page's link to a repository file outside docs/ (`../benchmarks/results/results.png`)
  works on GitHub as it is; on the site the file is copied in and the link pointed at it.
Nothing here reaches the network: the build works offline.
"""

from __future__ import annotations

import argparse
import posixpath
import re
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CLI_MARKER = "<!-- cli-reference -->"
OUTSIDE_LINK = re.compile(r"(\]\()((?:\.\./)+)([^)#\s]+)")
CODE_SPAN = re.compile(r"`[^`\n]*`")


def cli_reference() -> str:
    """Markdown for every command of `ddpkit` and every flag, as the parser declares them."""
    from ddpkit.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    helps = {choice.dest: choice.help for choice in sub._choices_actions}
    parts = []
    for name, command in sub.choices.items():
        parts.append(f"### ddpkit {name}\n")
        parts.append(f"{_escape(helps.get(name) or '')}.\n" if helps.get(name) else "")
        usage = command.format_usage().removeprefix("usage: ").strip()
        parts.append(f"```text\n{usage}\n```\n")
        if command.description:
            parts.append(_escape(" ".join(command.description.split())) + "\n")
        parts.append(_groups(command))
    return "\n".join(p for p in parts if p)


def _groups(parser: argparse.ArgumentParser) -> str:
    formatter = parser._get_formatter()
    out = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.help != argparse.SUPPRESS]
        if not actions:
            continue
        out.append(f"**{_escape(group.title or 'options')}**\n")
        out.append("| flag | meaning |\n|---|---|")
        for action in actions:
            invocation = formatter._format_action_invocation(action)
            names = ", ".join(f"`{part.strip()}`" for part in invocation.split(", "))
            text = formatter._expand_help(action) if action.help else ""
            if action.choices and not isinstance(action, argparse._SubParsersAction):
                text += f" (one of: {', '.join(f'`{c}`' for c in action.choices)})"
            out.append(f"| {_cell(names)} | {_cell(_escape(text))} |")
        out.append("")
    return "\n".join(out) + "\n"


def _escape(text: str) -> str:
    """Help text as Markdown shows it: no HTML, no emphasis, no link syntax."""
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return re.sub(r"([*_\[\]])", r"\\\1", text)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    files.append(File.generated(config, "index.md", content=readme_for_site(readme)))
    return files


def readme_for_site(readme: str) -> str:
    """README.md as the site's home page: its links into docs/ are links between pages there."""
    return re.sub(r"\]\(docs/", "](", readme)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    markdown = "\n".join(_table_row(line) if line.startswith("|") else line for line in markdown.split("\n"))
    depth = page.file.src_uri.count("/")
    markdown = markdown.replace("](" + "../" * (depth + 1) + "README.md", "](" + "../" * depth + "index.md")
    return OUTSIDE_LINK.sub(lambda m: _copied(m, page, config, files), markdown)


def _table_row(line: str) -> str:
    """A table row's inline code without the backslashes GitHub needs before its pipes
    (`a\\|b`): Python-Markdown would show them, and does not split a cell inside backticks."""
    return CODE_SPAN.sub(lambda m: m.group(0).replace("\\|", "|"), line)


def _copied(m: re.Match[str], page: Any, config: Any, files: Any) -> str:
    """A link to a repository file outside docs/: the file is copied to the site's repo/ folder
    and the link points there."""
    from mkdocs.structure.files import File

    page_dir = posixpath.dirname(page.file.src_uri)
    target = posixpath.normpath(posixpath.join("docs", page_dir, m.group(2) + m.group(3)))
    if target.startswith(("docs/", "../")) or not (REPO / target).is_file():
        return m.group(0)  # not a repository file outside docs/: MkDocs checks it as it is
    uri = f"repo/{target}"
    if files.get_file_from_path(uri) is None:
        files.append(File.generated(config, uri, abs_src_path=str(REPO / target)))
    return m.group(1) + posixpath.relpath(uri, page_dir or ".")


if __name__ == "__main__":
    print(cli_reference())
