"""Assembles the Typer app. Commands live one per module; this file only wires them.

Nothing imported here loads torch, diffusers, decord or av: `--help` and usage errors answer at once.
"""

from __future__ import annotations

import sys

import typer

from vaecache import __version__
from vaecache.cli.common import is_launcher_rank0
from vaecache.cli.decode import decode
from vaecache.cli.demo import demo, demo_data
from vaecache.cli.embed import embed
from vaecache.cli.encode import encode
from vaecache.cli.export import export
from vaecache.cli.index import index
from vaecache.cli.inspect import inspect
from vaecache.cli.plan import plan
from vaecache.cli.report import report
from vaecache.cli.usage import Command, Group
from vaecache.cli.verify import verify
from vaecache.errors import EXIT_INTERRUPTED

app = typer.Typer(
    name="vaecache",
    help="Precompute video VAE latents at cluster scale into verified safetensors shards.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=Group,
)
app.command("index", cls=Command)(index)
app.command("encode", cls=Command)(encode)
app.command("plan", cls=Command)(plan)
app.command("verify", cls=Command)(verify)
app.command("inspect", cls=Command)(inspect)
app.command("export", cls=Command)(export)
app.command("embed", cls=Command)(embed)
app.command("decode", cls=Command)(decode)
app.command("report", cls=Command)(report)
app.command("demo-data", cls=Command)(demo_data)
app.command("demo", cls=Command)(demo)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"vaecache {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       metavar="", help="Print the version and exit.")) -> None:
    """vaecache: index, encode, plan, verify, inspect, export, decode, report, demo-data, demo."""


def main(args: list[str] | None = None) -> None:
    """The `vaecache` console script. Under torchrun or srun, a usage error is printed by rank 0 alone."""
    if is_launcher_rank0():
        app(args=args, prog_name="vaecache")
        return
    command = typer.main.get_command(app)
    try:
        code = command.main(args=args, prog_name="vaecache", standalone_mode=False)
    except typer.Abort:
        sys.exit(EXIT_INTERRUPTED)
    except typer.TyperException as exc:  # typer's own usage errors: the same typo on every rank, rank 0 says it
        sys.exit(getattr(exc, "exit_code", 2))
    sys.exit(code if isinstance(code, int) else 0)
