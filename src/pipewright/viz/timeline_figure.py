"""Timeline pictures like the papers' figures: ranks × time, one colour per action kind.

Compute spans fill most of a rank's row, labelled with their microbatch when wide enough; transfers and
collectives (stream "comm") are a thin bar at the bottom of the row; idle time stays white. Several
timelines (e.g. measured above predicted) are stacked as panels sharing the time axis.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from pipewright.timeline import Timeline

#: Colours of the core kinds (forward blue, backward/input-gradient green, weight-gradient orange).
KIND_COLOURS = {
    "F": "#4c78a8",
    "B": "#54a24b",
    "I": "#8fd175",
    "W": "#f58518",
    "STEP": "#7f7f7f",
    "comm": "#b279a2",
}
#: Colours handed out, in order of first appearance, to kinds without a fixed colour (extensions).
_EXTRA_COLOURS = ("#e45756", "#72b7b2", "#eeca3b", "#ff9da6", "#9d755d", "#bab0ac", "#17becf", "#bcbd22")
_LABEL_MIN_PX = 14.0
_MAX_LABELS = 4000


def kind_colours(timelines: Sequence[Timeline]) -> dict[str, str]:
    """Colour per kind shown: the fixed ones, then distinct colours for any other compute kind."""
    colours = dict(KIND_COLOURS)
    extra = iter(_EXTRA_COLOURS * (1 + len(timelines)))
    for tl in timelines:
        for span in tl.spans:
            if span.stream == "compute" and span.action.kind not in colours:
                colours[span.action.kind] = next(extra, "#000000")
    return colours


def draw_timeline(
    timelines: Timeline | Sequence[Timeline],
    path: str | Path,
    titles: Sequence[str] | None = None,
    *,
    width: float = 12.0,
    dpi: int = 120,
    xlabel: str = "time (s)",
    note: str | None = None,
) -> Path:
    """Write a PNG of one or more timelines (one panel each, stacked, shared time axis). The x label
    says what the numbers in the boxes are (microbatches) and, for a timeline whose ``meta`` has
    ``dp`` > 1, that one data-parallel replica is drawn; ``note`` adds to it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    tls = [timelines] if isinstance(timelines, Timeline) else list(timelines)
    if not tls:
        raise ValueError("draw_timeline needs at least one timeline")
    titles = list(titles) if titles is not None else [_default_title(tl) for tl in tls]
    colours = kind_colours(tls)
    heights = [max(tl.num_ranks, 1) * 0.32 + 0.7 for tl in tls]
    fig, axes = plt.subplots(
        len(tls),
        1,
        figsize=(width, sum(heights) + 0.6),
        sharex=True,
        squeeze=False,
        gridspec_kw={"height_ratios": heights},
    )
    t0 = min(tl.start for tl in tls)
    t1 = max(tl.end for tl in tls)
    span_x = (t1 - t0) or 1.0
    used: set[str] = set()
    for ax, tl, title in zip(axes[:, 0], tls, titles, strict=True):
        used |= _draw_panel(ax, tl, colours, t0, span_x, width * dpi * 0.85)
        ax.set_title(title, fontsize=10, loc="left")
    axes[-1, 0].set_xlabel(f"{xlabel}    [{_legend_note(tls, note)}]")
    axes[-1, 0].set_xlim(t0, t0 + span_x)
    order = [k for k in colours if k in used]
    fig.legend(
        handles=[Patch(color=colours[k], label=k) for k in order],
        loc="upper right",
        ncol=len(order),
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    out = Path(path)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


def _legend_note(tls: Sequence[Timeline], note: str | None) -> str:
    parts = ["numbers in boxes: microbatch"]
    dp = max(int(tl.meta.get("dp", 1) or 1) for tl in tls)
    if dp > 1:
        parts.append(f"one data-parallel replica of {dp} drawn")
    return "; ".join(parts + ([note] if note else []))


def _default_title(tl: Timeline) -> str:
    name = tl.meta.get("schedule", "")
    return f"{name} ({tl.source})" if name else tl.source


def _draw_panel(ax, tl: Timeline, colours: dict[str, str], t0: float, span_x: float, px: float) -> set[str]:
    bars: dict[str, dict[int, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    labels = []
    for s in tl.spans:
        key = "comm" if s.stream != "compute" else s.action.kind
        bars[key][s.rank].append((s.start, s.end - s.start))
        if s.stream == "compute" and s.action.microbatch is not None:
            labels.append(s)
    for key, per_rank in bars.items():
        comm = key == "comm"
        for rank, xs in per_rank.items():
            y = rank + (0.25 if comm else -0.4)
            h = 0.15 if comm else 0.65
            ax.broken_barh(
                xs, (y, h), facecolors=colours.get(key, "#000000"), edgecolor="white", linewidth=0.3
            )
    if len(labels) <= _MAX_LABELS:
        for s in labels:
            if (s.end - s.start) / span_x * px >= _LABEL_MIN_PX:
                ax.text(
                    (s.start + s.end) / 2,
                    rank_y(s.rank),
                    str(s.action.microbatch),
                    ha="center",
                    va="center",
                    fontsize=6,
                    color="white",
                )
    ax.set_ylim(tl.num_ranks - 0.4, -0.6)
    ax.set_yticks(range(tl.num_ranks))
    ax.set_yticklabels([f"rank {r}" for r in range(tl.num_ranks)], fontsize=7)
    ax.set_facecolor("white")
    ax.grid(False)
    return set(bars)


def rank_y(rank: int) -> float:
    """Vertical centre of a rank's compute bar."""
    return rank - 0.4 + 0.65 / 2
