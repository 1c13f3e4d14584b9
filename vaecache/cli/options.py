"""The flags of `vaecache encode` and `vaecache plan`, made from the option table (vaecache.settings.options): a
flag is declared there once, and each command's function receives the ones it takes as one `flags` dict.

Typer reads a command's parameters from its signature; `with_setting_flags(command)` gives the function a
signature holding its own parameters (DATA, --config, --json, ...) and one Optional parameter per option of
`command` (None when the flag is not given, so a TOML file or the default decides).
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Annotated, Any, Callable, Optional, TypeVar

import typer

from vaecache.settings.options import Option, options_of

F = TypeVar("F", bound=Callable[..., Any])


OTHER_PANEL = "More options"
"""The --help panel of every option of encode and plan that has a default (--config and --json too); the required
ones (and --help) are in Typer's first panel, "Options"."""


def typer_parameter(option: Option, command: str) -> inspect.Parameter:
    names = [option.flag] + ([option.short] if option.short else [])
    info = typer.Option(*names, help=option.help_for(command), metavar="" if option.kind is bool else None,
                        rich_help_panel=None if option.required else OTHER_PANEL)
    return inspect.Parameter(option.name, inspect.Parameter.KEYWORD_ONLY, default=None,
                             annotation=Annotated[Optional[option.kind], info])  # type: ignore[valid-type]


def with_setting_flags(command: str) -> Callable[[F], F]:
    """Give `fn(..., flags: dict[str, Any])` a parameter per option of `command`; the flags given reach it in
    `flags` (option name -> value, None where not given)."""

    def decorate(fn: F) -> F:
        signature = inspect.signature(fn, eval_str=True)
        own = [p for name, p in signature.parameters.items() if name != "flags"]
        options = options_of(command)
        for parameter in own[1:]:  # --config, --json: with the other options, after the required ones
            for info in (*getattr(parameter.annotation, "__metadata__", ()), parameter.default):
                if isinstance(info, typer.models.OptionInfo):
                    info.rich_help_panel = OTHER_PANEL

        @functools.wraps(fn)
        def command_function(*args: Any, **kwargs: Any) -> Any:
            flags = {option.name: kwargs.pop(option.name, None) for option in options}
            return fn(*args, flags=flags, **kwargs)

        required = [typer_parameter(option, command) for option in options if option.required]
        others = [typer_parameter(option, command) for option in options if not option.required]
        # DATA, then the required options, then the rest: --help lists them in this order (keyword-only after DATA)
        parameters = [*own[:1], *required, *others,
                      *(p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own[1:])]
        command_function.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
        command_function.__annotations__ = {p.name: p.annotation for p in parameters}
        del command_function.__wrapped__  # type: ignore[attr-defined]  # Typer reads __signature__, not fn's own
        return command_function  # type: ignore[return-value]

    return decorate


def table_flag(name: str, command: str) -> Any:
    """The flag `name` of the option table as `command` takes it, for a command with its own signature: an
    Annotated Optional type with Typer's option info (None when not given)."""
    option = next(option for option in options_of(command) if option.name == name)
    info = typer.Option(option.flag, help=option.help_for(command))
    return Annotated[Optional[option.kind], info]  # type: ignore[valid-type]


StorageOption = table_flag("storage_option", "verify")
"""--storage-option of verify, inspect, export and index (encode and plan take it through with_setting_flags)."""

DataArgument = Annotated[str, typer.Argument(
    metavar="DATA", help="Dataset: DATA/<scene>/<camera>.mp4 or DATA/<scene>/<camera>/<frames>, a folder of videos, a "
                         ".jsonl index, a .csv/.tsv/.parquet table, WebDataset .tar shards (a file, a folder, or "
                         "data-{000000..000099}.tar), a LeRobot dataset or a nuScenes root; or the s3:// URL of any "
                         "of them.")]
ConfigOption = Annotated[Optional[Path], typer.Option("--config", help="TOML file with these options (long flag "
                                                                     "names as keys; flags win).")]
