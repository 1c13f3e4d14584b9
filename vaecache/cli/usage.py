"""How vaecache's commands answer usage: --help that reads at 80 columns (a flag shows no value placeholder, where
Typer gives --help `<bool>`), and every missing required parameter named in one message (click names the first)."""

from __future__ import annotations

from typing import Any

from typer._click.exceptions import MissingParameter
from typer.core import TyperCommand, TyperGroup


def _without_placeholder(option: Any) -> Any:
    if option is not None:
        option.metavar = ""  # a flag takes no value: nothing to show in the value column
    return option


def _shown(param: Any) -> str:
    """How a message names a parameter: an argument by its metavar, an option by its long flag."""
    if param.param_type_name == "argument":
        return param.metavar or param.name.upper()
    return max(param.opts, key=len)


class Command(TyperCommand):
    """A vaecache command: its --help flag shows no value; every missing required parameter is named at once."""

    def get_help_option(self, ctx: Any) -> Any:
        return _without_placeholder(super().get_help_option(ctx))

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        given = list(args)
        try:
            return super().parse_args(ctx, args)
        except MissingParameter:
            found, _, _ = self.make_parser(ctx).parse_args(args=list(given))
            missing = [param for param in self.get_params(ctx)
                       if param.required and found.get(param.name) is None and not param.envvar]
            if len(missing) < 2:
                raise
            names = [f"'{_shown(param)}'" for param in missing]
            ctx.fail(f"Missing {', '.join(names[:-1])} and {names[-1]}.")
            raise  # ctx.fail raised


class Group(TyperGroup):
    """The vaecache app: its --help flag shows no value."""

    def get_help_option(self, ctx: Any) -> Any:
        return _without_placeholder(super().get_help_option(ctx))
