"""Assembles the Typer app. Commands live one per module; this file only wires them."""

from __future__ import annotations

import typer

from vaecache import __version__
from vaecache.cli.demo import demo, demo_data
from vaecache.cli.encode import encode
from vaecache.cli.plan import plan
from vaecache.cli.verify import verify

app = typer.Typer(
    name="vaecache",
    help="Precompute video VAE latents at cluster scale into verified safetensors shards.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("encode")(encode)
app.command("plan")(plan)
app.command("verify")(verify)
app.command("demo-data")(demo_data)
app.command("demo")(demo)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"vaecache {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """vaecache: encode, plan, verify, demo-data, demo."""


def main() -> None:
    app(prog_name="vaecache")
