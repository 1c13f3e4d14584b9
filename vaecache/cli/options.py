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

from vaecache.settings.options import PANELS, Option, options_of

F = TypeVar("F", bound=Callable[..., Any])


def typer_parameter(option: Option, command: str) -> inspect.Parameter:
    names = [option.flag] + ([option.short] if option.short else [])
    info = typer.Option(*names, help=option.help_for(command), metavar=option.value_name,
                        rich_help_panel=option.panel)
    return inspect.Parameter(option.name, inspect.Parameter.KEYWORD_ONLY, default=None,
                             annotation=Annotated[Optional[option.kind], info])  # type: ignore[valid-type]


def with_setting_flags(command: str) -> Callable[[F], F]:
    """Give `fn(..., flags: dict[str, Any])` a parameter per option of `command`; the flags given reach it in
    `flags` (option name -> value, None where not given)."""

    def decorate(fn: F) -> F:
        signature = inspect.signature(fn, eval_str=True)
        own = [p for name, p in signature.parameters.items() if name != "flags"]
        options = options_of(command)

        @functools.wraps(fn)
        def command_function(*args: Any, **kwargs: Any) -> Any:
            flags = {option.name: kwargs.pop(option.name, None) for option in options}
            return fn(*args, flags=flags, **kwargs)

        required = [typer_parameter(option, command) for option in options if option.required]
        others = [typer_parameter(option, command)
                  for option in sorted((option for option in options if not option.required),
                                       key=lambda option: PANELS.index(option.panel))]
        # DATA, the required options, the command's own (--config, --json), then the rest by panel: --help lists a
        # first run's options first
        parameters = [*own[:1], *required, *(p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own[1:]),
                      *others]
        command_function.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
        command_function.__annotations__ = {p.name: p.annotation for p in parameters}
        del command_function.__wrapped__  # type: ignore[attr-defined]  # Typer reads __signature__, not fn's own
        return command_function  # type: ignore[return-value]

    return decorate


def table_flag(name: str, command: str, panel: str | None = None) -> Any:
    """The flag `name` of the option table as `command` takes it, for a command with its own signature: an
    Annotated Optional type with Typer's option info (None when not given), in the --help panel `panel`."""
    option = next(option for option in options_of(command) if option.name == name)
    info = typer.Option(option.flag, help=option.help_for(command), metavar=option.value_name, rich_help_panel=panel)
    return Annotated[Optional[option.kind], info]  # type: ignore[valid-type]


StorageOption = table_flag("storage_option", "verify")  # with the command's first options: OUT may be a URL
"""--storage-option of verify, inspect, export and index (encode and plan take it through with_setting_flags)."""

DataArgument = Annotated[str, typer.Argument(
    metavar="DATA", help="Dataset folder, index, table, .tar shards, LeRobot or nuScenes root, or s3:// URL.")]
ConfigOption = Annotated[Optional[Path], typer.Option("--config", metavar="FILE", help="TOML file of these options "
                                                                                   "(flags win).")]
