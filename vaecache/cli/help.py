"""--help that reads at 80 columns: the help flag itself shows no value placeholder (Typer gives it `<bool>`)."""

from __future__ import annotations

from typing import Any

from typer.core import TyperCommand, TyperGroup


def _without_placeholder(option: Any) -> Any:
    if option is not None:
        option.metavar = ""  # a flag takes no value: nothing to show in the value column
    return option


class Command(TyperCommand):
    """A vaecache command: its --help flag shows no value."""

    def get_help_option(self, ctx: Any) -> Any:
        return _without_placeholder(super().get_help_option(ctx))


class Group(TyperGroup):
    """The vaecache app: its --help flag shows no value."""

    def get_help_option(self, ctx: Any) -> Any:
        return _without_placeholder(super().get_help_option(ctx))
