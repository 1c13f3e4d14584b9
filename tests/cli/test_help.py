"""Every command's --help reads at 80 columns: no flag name cut, no value placeholder on a flag that takes none
(--help, --version, a boolean), the options a first run needs in the first panel, one line of help per option
before it wraps (the detail is docs/commands.md's)."""

from __future__ import annotations

import re
from typing import Callable

import pytest
import typer

from vaecache.cli.app import app

COMMANDS = sorted(typer.main.get_command(app).commands)
COMMANDS_IN_ORDER = list(typer.main.get_command(app).commands)
FIRST_RUN = {"encode": ["--out", "--vae", "--num-frames", "--size"], "plan": ["--vae", "--num-frames", "--size"],
             "index": ["--output"], "export": ["--format", "--out"]}


def help_at_80(run_cli: Callable, command: str | None) -> str:
    result = run_cli([*([command] if command else []), "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    return result.output


def flags_of(command: str | None) -> list[str]:
    group = typer.main.get_command(app)
    params = group.commands[command].params if command else group.params  # type: ignore[attr-defined]
    return [flag for param in params if param.param_type_name == "option"
            for flag in (*param.opts, *param.secondary_opts) if flag.startswith("--")]


@pytest.mark.parametrize("command", [None, *COMMANDS], ids=lambda name: name or "vaecache")
def test_help_at_80_columns_cuts_no_flag_and_shows_no_placeholder_on_a_flag(run_cli: Callable,
                                                                              command: str | None) -> None:
    text = help_at_80(run_cli, command)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in text, [line for line in lines if "…" in line]
    shown = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", text))
    assert set(flags_of(command)) <= shown, sorted(set(flags_of(command)) - shown)
    for flag in ("--help", "--version", "--tiling", "--quick", "--overwrite"):
        for line in (line for line in lines if re.search(rf"│ {flag}\s", line)):
            assert "<bool>" not in line, line


@pytest.mark.parametrize("command", sorted(FIRST_RUN))
def test_a_first_runs_options_come_first_in_the_first_panel(run_cli: Callable, command: str) -> None:
    text = help_at_80(run_cli, command)
    first_panel = text.split("╭─ Options ")[1].split("╰")[0]
    listed = re.findall(r"^│ (?:\*  |   )?(--[a-z-]+)", first_panel, flags=re.M)
    assert listed[:len(FIRST_RUN[command])] == FIRST_RUN[command], listed
    assert "--help" in listed


def test_encode_help_groups_the_rest_by_topic(run_cli: Callable) -> None:
    text = help_at_80(run_cli, "encode")
    panels = re.findall(r"╭─ (.+?) ─", text)
    assert panels == ["Arguments", "Options", "Input", "Clips", "VAE and numerics", "Parallel and speed", "Output",
                      "Sets added once the cache is finished"]
    assert len(text.splitlines()) < 160  # was 447 lines before the panels and one-line helps


def test_the_command_list_gives_each_command_one_line(run_cli: Callable) -> None:
    rows = [row for row in help_at_80(run_cli, None).split("╭─ Commands ")[1].splitlines() if row.startswith("│")]
    assert [row.split()[1] for row in rows] == COMMANDS_IN_ORDER


def test_embed_help_has_a_panel_per_kind_from_the_kinds_own_declarations(run_cli: Callable) -> None:
    from vaecache.edges import kind_edges

    text = help_at_80(run_cli, "embed")
    assert re.findall(r"╭─ (.+?) ─", text) == ["Arguments", "Options", *(edges.panel for edges in kind_edges())]
    for edges in kind_edges():
        panel = text.split(f"╭─ {edges.panel} ")[1].split("╰")[0]
        assert re.findall(r"^│ (--[a-z0-9-]+)", panel, flags=re.M) == [option.flag for option in edges.options]
