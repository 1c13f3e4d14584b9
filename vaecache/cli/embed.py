"""`vaecache embed`: sets of tensors added to a finished cache, one kind of set each (text embeddings, image-to-video
conditions, audio latents, a kind declared outside vaecache). The command's flags are the kinds' own declarations
(vaecache.cache.kinds.KindEdges), with the few every kind shares; it loops over the kinds asked, and prints each set
written with one printer."""

from __future__ import annotations

import functools
import inspect
import time
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
from rich.markup import escape

from vaecache.cli.common import console, human_bytes, report_errors
from vaecache.cli.options import StorageOption

if TYPE_CHECKING:
    from vaecache.cache.kinds import SetOutcome
    from vaecache.edges import KindEdges


def _kind_parameters() -> list[inspect.Parameter]:
    from vaecache.edges import kind_edges

    return [inspect.Parameter(option.name, inspect.Parameter.KEYWORD_ONLY, default=option.default,
                              annotation=Annotated[Optional[option.kind], typer.Option(  # type: ignore[valid-type]
                                  option.flag, help=option.help, metavar=option.metavar,
                                  rich_help_panel=edges.panel)])
            for edges in kind_edges() for option in edges.options]


def with_kind_flags(fn: Any) -> Any:
    """Give `fn(out, ..., given)` a keyword parameter per option every kind declares; the kinds' flags reach it in
    `given` (option name -> value, None where not given)."""
    signature = inspect.signature(fn, eval_str=True)
    own = [parameter for name, parameter in signature.parameters.items() if name != "given"]
    kinds = _kind_parameters()

    @functools.wraps(fn)
    def command_function(*args: Any, **kwargs: Any) -> Any:
        given = {parameter.name: kwargs.pop(parameter.name) for parameter in kinds}
        return fn(*args, given=given, **kwargs)

    parameters = [*own, *kinds]
    command_function.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    command_function.__annotations__ = {p.name: p.annotation for p in parameters}
    del command_function.__wrapped__  # type: ignore[attr-defined]  # Typer reads __signature__, not fn's own
    return command_function


@report_errors
@with_kind_flags
def embed(
    out: str = typer.Argument(..., metavar="OUT", help="A finished cache: a folder, or its s3:// URL."),
    set_name: Optional[str] = typer.Option(None, "--set", help="The set's name (default: default).",
                                           metavar="NAME"),
    replace: bool = typer.Option(False, "--replace", help="Replace a set made from other inputs.", metavar=""),
    shard_size: str = typer.Option("256MiB", "--shard-size", help="Bytes per shard.", metavar="BYTES"),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda[:N].", metavar="TEXT"),
    allow_pickle_weights: bool = typer.Option(False, "--allow-pickle-weights",
                                              help="Let pickled .bin weights load (runs code).", metavar=""),
    storage_option: StorageOption = None,
    *,
    given: dict[str, Any],
) -> None:
    """Add text, I2V-condition or audio sets to a finished cache."""
    from vaecache.distributed.context import distributed
    from vaecache.edges import EmbedShared, kind_edges
    from vaecache.errors import UsageError
    from vaecache.settings.options import parse_bytes
    from vaecache.urls import parse_storage_options

    shared = EmbedShared(out=out, set_name=set_name, replace=replace, shard_bytes=parse_bytes(shard_size),
                         device=device, allow_pickle_weights=allow_pickle_weights,
                         storage_options=tuple(parse_storage_options(storage_option)))
    every = kind_edges()
    for edges in every:
        edges.check_given(given, shared)
    asked = [edges for edges in every if edges.asked(given)]
    if set_name is not None and sum(edges.takes_set_name for edges in asked) > 1:
        raise UsageError("--set names one set: give it with one of --text-encoder, --kind and --audio-vae")
    if not asked:
        raise UsageError("embed needs --text-encoder SPEC (caption embeddings) and/or --condition KIND "
                         "(image-to-video conditions), --audio-vae SPEC (audio latents), or --kind MODULE")
    requests = [(edges, request, edges.set_kind(request).what)
                for edges, request in ((edges, edges.request(given, shared)) for edges in asked)]
    done = []
    with distributed(device=device) as ctx:  # under torchrun the shards are split across the ranks
        for edges, request, what in requests:
            started = time.perf_counter()
            outcomes = edges.embed(request, ctx)
            done.extend((edges, what, outcome, time.perf_counter() - started) for outcome in outcomes)
        if ctx.info.rank != 0:
            return
    for edges, what, outcome, seconds in done:
        for line in outcome_lines(edges, what, outcome, seconds):
            console.print(escape(line), soft_wrap=True)


def outcome_lines(edges: KindEdges, what: str, outcome: SetOutcome, seconds: float | None = None) -> list[str]:
    """What a run says of one set it wrote, from the one outcome every kind's embed returns: with `seconds`, embed's
    lines (the files, what was computed, copied, kept or repaired); without, encode's one line. The kind's notes
    follow either."""
    where = outcome.extra.get("out")
    counts = edges.counts(outcome)
    notes = [f"  {note}" for note in edges.notes(outcome)]
    verb = ("up to date" if outcome.unchanged else
            "repaired" if outcome.repaired and not (outcome.replaced or outcome.updated) else
            "replaced" if outcome.replaced else "updated" if outcome.updated else "added")
    if seconds is None:
        return [f"{what} {outcome.name!r} {verb}: {counts}", *notes]
    if outcome.unchanged:
        return [f"{what} {outcome.name!r} of {where} is up to date ({counts}): nothing written"]
    record = outcome.record or {}
    files = len(record.get("shards") or []) + len(record.get("tables") or {})
    size = (sum(shard["bytes"] for shard in record.get("shards") or [])
            + sum(table["bytes"] for table in (record.get("tables") or {}).values()))
    lines = [f"{verb} {what} {outcome.name!r} in {where}: {counts}, {files} files, {human_bytes(size)}, "
             f"{seconds:.1f} s", "  " + ", ".join(_work(outcome, edges.items))]
    if outcome.repaired:
        lines.append(f"  {len(outcome.repaired)} shard(s) missing or damaged, computed again: "
                     f"{', '.join(outcome.repaired[:3])}{' ...' if len(outcome.repaired) > 3 else ''}")
    return [*lines, *notes]


def _work(outcome: SetOutcome, items: str) -> list[str]:
    """What ran the encoder, and what was kept or copied instead."""
    parts = [f"{outcome.computed} {items} computed"]
    if outcome.copied:
        parts.append(f"{outcome.copied} copied from the set before")
    if outcome.resumed:
        parts.append(f"{outcome.resumed} shard(s) an interrupted run committed kept")
    return parts


__all__ = ["embed", "outcome_lines"]
