"""README and docs/ stay true: every relative link reaches a file and a heading there, every command's flag table
in docs/commands.md lists exactly the options its --help shows, and README stays a landing page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer

from vaecache.cli.app import app

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown page (code blocks skipped), plus explicit <a id> anchors."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code:
            continue
        found.update(re.findall(r'<a id="([^"]+)"></a>', line))
        heading = re.match(r"#{1,6} (.*)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [target for target in LINK.findall(text) if not target.startswith(("http://", "https://", "mailto:"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_reaches_a_file_and_a_heading(page: Path) -> None:
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading '{anchor}' in {file.relative_to(ROOT)}")
    assert not broken, broken


def test_readme_is_a_landing_page_that_links_every_docs_topic() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 260
    for topic in sorted((ROOT / "docs").glob("*.md")):
        assert f"docs/{topic.name}" in readme, f"README does not link docs/{topic.name}"


def command_sections() -> dict[str, str]:
    """docs/commands.md: command name -> the text of its section."""
    text = (ROOT / "docs" / "commands.md").read_text()
    parts = re.split(r"^## `vaecache ([a-z-]+)[^\n]*\n", text, flags=re.M)
    return {parts[i]: parts[i + 1].split("\n## ")[0] for i in range(1, len(parts), 2)}


def documented_flags(section: str) -> set[str]:
    flags: set[str] = set()
    for line in section.splitlines():
        cells = line.split("|")
        if line.startswith("| `-") and len(cells) > 2:
            flags.update(re.findall(r"(?<![\w-])--?[a-z][a-z0-9-]*", cells[1]))
    return flags


def help_flags(name: str) -> set[str]:
    command = typer.main.get_command(app).commands[name]
    flags: set[str] = set()
    for param in command.params:
        if param.param_type_name == "option":
            flags.update(param.opts)
            flags.update(param.secondary_opts)
    return flags - {"--help"}


@pytest.mark.parametrize("name", sorted(typer.main.get_command(app).commands))
def test_each_commands_flag_table_lists_exactly_its_options(name: str) -> None:
    sections = command_sections()
    assert name in sections, f"docs/commands.md has no section for vaecache {name}"
    documented, actual = documented_flags(sections[name]), help_flags(name)
    assert documented == actual, {"in --help, not in the table": sorted(actual - documented),
                                  "in the table, not in --help": sorted(documented - actual)}
