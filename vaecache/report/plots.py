"""The report's charts, drawn by matplotlib (the optional extra `vaecache[report]`) with its Agg renderer into PNG
files: no display, no pyplot state, and labels that are user data (camera names, reasons) drawn as plain text
(`text.parse_math` off: a `$` in a name is a dollar sign, not mathtext)."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any, Iterator, Sequence

from vaecache.errors import MissingExtraError

INK, ACCENT, WARN, BAND = "#23313f", "#2f6db3", "#c0392b", "#dfe9f5"
STYLE = {"text.parse_math": False, "font.size": 9, "axes.titlesize": 10, "axes.edgecolor": "#8a96a3",
         "axes.spines.top": False, "axes.spines.right": False, "savefig.dpi": 100, "figure.dpi": 100,
         "svg.fonttype": "none"}
WIDTH_IN = 4.8
"""Charts are 480 pixels wide (100 dpi): two side by side on the page."""
LABEL_CHARS = 32
"""Longer labels (user data) are cut to this many characters on a chart; the page's tables show them whole."""


def require_matplotlib() -> None:
    """The report's charts need matplotlib: a one-line MissingExtraError naming the extra when it is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MissingExtraError("vaecache report draws its charts with matplotlib, which is not installed: "
                                "pip install 'vaecache[report]'") from None


@contextlib.contextmanager
def _figure(path: Path, width: float, height: float) -> Iterator[Any]:
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    with matplotlib.rc_context(STYLE):
        figure = Figure(figsize=(width, height), layout="constrained")
        FigureCanvasAgg(figure)
        yield figure
        figure.savefig(path, format="png", metadata={"Software": None})


def _label(text: Any) -> str:
    text = str(text)
    return text if len(text) <= LABEL_CHARS else text[:LABEL_CHARS - 1] + "…"


def bar_chart(path: Path, labels: Sequence[Any], values: Sequence[float], *, title: str, xlabel: str,
              horizontal: bool = False) -> None:
    """Bars of `values` named by `labels` (horizontal: one row per label, for long names)."""
    names = [_label(label) for label in labels]
    rows = max(1, len(names))
    from matplotlib.ticker import MaxNLocator

    with _figure(path, WIDTH_IN, (1.0 + 0.26 * rows) if horizontal else 2.6) as figure:
        axes = figure.add_subplot()
        (axes.xaxis if horizontal else axes.yaxis).set_major_locator(MaxNLocator(integer=True))
        if horizontal:
            positions = list(range(rows))[::-1]
            axes.barh(positions, values, color=ACCENT)
            axes.set_yticks(positions, names)
            axes.set_xlabel(xlabel)
        else:
            axes.bar(range(len(names)), values, color=ACCENT)
            axes.set_xticks(range(len(names)), names, rotation=30 if len(names) > 6 else 0, ha="right"
                            if len(names) > 6 else "center")
            axes.set_ylabel(xlabel)
        axes.set_title(title)


def histogram(path: Path, values: Sequence[float], weights: Sequence[float], *, title: str, xlabel: str) -> None:
    """A histogram of `values` counted `weights` times (the table's counters: value -> clips)."""
    from matplotlib.ticker import MaxNLocator

    with _figure(path, WIDTH_IN, 2.6) as figure:
        axes = figure.add_subplot()
        axes.yaxis.set_major_locator(MaxNLocator(integer=True))
        distinct = sorted(set(values))
        bins: Any = min(40, len(distinct)) if len(distinct) > 1 else 1
        axes.hist(values, bins=bins, weights=weights, color=ACCENT, edgecolor="white")
        axes.set_title(title)
        axes.set_xlabel(xlabel)
        axes.set_ylabel("clips")


def scale_chart(path: Path, channels: Sequence[Any], band: Any) -> None:
    """Per channel, the normalized mean and std (points) against the band around the reference (shaded); flagged
    channels in red. `channels` are vaecache.report.scale.ChannelScale, `band` its Band."""
    index = [c.channel for c in channels]
    color = [WARN if c.problems else ACCENT for c in channels]
    with _figure(path, 2 * WIDTH_IN, 3.6) as figure:
        top, bottom = figure.subplots(2, 1, sharex=True)
        for c in channels:
            if c.reference_mean is not None:
                top.fill_between([c.channel - 0.4, c.channel + 0.4], c.reference_mean - band.mean * c.reference_std,
                                 c.reference_mean + band.mean * c.reference_std, color=BAND, linewidth=0)
            bottom.fill_between([c.channel - 0.4, c.channel + 0.4], band.std_low * c.reference_std,
                                band.std_high * c.reference_std, color=BAND, linewidth=0)
            bottom.plot([c.channel - 0.4, c.channel + 0.4], [c.reference_std] * 2, color="#8a96a3", linewidth=1)
        top.scatter(index, [_finite(c.mean) for c in channels], c=color, zorder=3, s=18)
        top.axhline(0.0, color="#8a96a3", linewidth=0.8)
        top.set_ylabel("mean")
        top.set_title("normalized latents per channel (shaded: the band around the reference)")
        bottom.scatter(index, [_finite(c.std) for c in channels], c=color, zorder=3, s=18)
        bottom.set_ylabel("std")
        bottom.set_xlabel("latent channel")
        bottom.set_ylim(bottom=0)
        bottom.set_xticks(index if len(index) <= 32 else index[::max(1, len(index) // 16)])


def spectrogram(path: Path, samples: Any, rate: int) -> None:
    """A clip's sound as a spectrogram (the channels' mean; dB, Hann window of 1024 samples, 75 % overlap)."""
    import numpy as np

    mono = np.asarray(samples, dtype=np.float64).mean(axis=0)
    with _figure(path, WIDTH_IN, 2.2) as figure:
        axes = figure.add_subplot()
        nfft = min(1024, max(16, 2 ** int(math.log2(max(16, len(mono) // 4)))))
        axes.specgram(mono if len(mono) >= nfft else np.pad(mono, (0, nfft - len(mono))), NFFT=nfft, Fs=rate,
                      noverlap=nfft * 3 // 4, cmap="magma", scale="dB")
        axes.set_xlabel("seconds")
        axes.set_ylabel("Hz")


def _finite(value: float) -> float:
    return value if math.isfinite(value) else float("nan")


__all__ = ["bar_chart", "histogram", "require_matplotlib", "scale_chart", "spectrogram"]
