"""Gantt chart of a simulated schedule (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

from .simulate import SimulationResult

_SHADE = {"F": 0.45, "B": 1.0, "I": 0.8, "W": 0.25}   # how dark an action's chunk colour is


def _colour(chunk: int, kind: str):
    import matplotlib

    base = matplotlib.colormaps["tab10"](chunk % 10)
    shade = _SHADE[kind]
    return tuple(1 - shade * (1 - c) for c in base[:3])   # blend towards white


def save_gantt(result: SimulationResult, path: str, title: str = "") -> None:
    """One row per pipeline rank (rank 0 on top); bars labelled ``kind micro-batch``, coloured by
    chunk, forwards light, backwards dark (ZB: I dark, W palest)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    pp_size = len(result.timelines)
    width = max(8.0, min(40.0, result.makespan * 0.35))
    fig, ax = plt.subplots(figsize=(width, 0.6 * pp_size + 1.4))
    chunks, kinds = set(), set()
    for rank, line in enumerate(result.timelines):
        for action, start, end in line:
            chunks.add(action.chunk)
            kinds.add(action.kind)
            ax.barh(rank, end - start, left=start, height=0.8, edgecolor="black",
                    linewidth=0.4, color=_colour(action.chunk, action.kind))
            ax.text((start + end) / 2, rank, f"{action.kind}{action.microbatch}",
                    ha="center", va="center", fontsize=7)
    ax.set_yticks(range(pp_size), [f"rank {r}" for r in range(pp_size)])
    ax.invert_yaxis()
    ax.set_xlim(0, result.makespan)
    ax.set_xlabel("time (cost units)")
    ax.set_title(title, fontsize=9)
    handles = [Patch(color=_colour(c, kind), label=f"{kind} chunk {c}")
               for c in sorted(chunks) for kind in ("F", "B", "I", "W") if kind in kinds]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
