"""Human-readable views of a RankLayout: the rank table, one rank's groups, batch arithmetic,
and a PNG of the rank grid. Pure formatting (matplotlib is imported only to draw).

    print(format_layout_table(RankLayout(8, tp=2, pp=2)))
"""
from __future__ import annotations

from fractions import Fraction

from .layout import GROUP_NAMES, RankLayout
from .microbatches import MicrobatchCalculator, bubble_fraction

MAX_LISTED_MEMBERS = 8
GROUP_ROLES = {
    "tp": "tensor parallel", "pp": "pipeline stages", "dp": "data parallel",
    "cp": "context parallel", "dp-cp": "data+context (grad all-reduce)",
    "tp-pp": "model parallel (one replica)", "tp-dp": "tensor+data", "tp-cp": "tensor+context",
    "tp-dp-cp": "tensor+data+context", "ep": "expert parallel", "etp": "expert tensor parallel",
    "etp-ep": "expert tensor+expert", "etp-ep-pp": "expert tensor+expert+pipeline",
    "edp": "expert data parallel", "embedding": "first+last stage (tied embedding)",
    "position-embedding": "first stage (position embedding)",
}


def format_group(ranks: list[int] | None) -> str:
    """``[0,4]``; long groups abbreviated to ``[0,1,2,…,63] (64)``; ``-`` for no group."""
    if not ranks:
        return "-"
    if len(ranks) > MAX_LISTED_MEMBERS:
        return "[" + ",".join(map(str, ranks[:3])) + f",…,{ranks[-1]}] ({len(ranks)})"
    return "[" + ",".join(map(str, ranks)) + "]"


def expert_side_differs(layout: RankLayout) -> bool:
    """True when MoE layers use a decomposition of their own (ep > 1 or etp ≠ tp)."""
    return layout.ep > 1 or layout.etp != layout.tp


def _coordinate_columns(layout: RankLayout) -> list[str]:
    columns = ["tp", "pp", "dp"]
    if layout.cp > 1:
        columns.insert(2, "cp")
    if expert_side_differs(layout):
        columns += ["ep", "etp", "edp"]
    return columns


def _group_columns(layout: RankLayout) -> list[tuple[str, str]]:
    """(header, group name) of the groups worth a column: those with more than one rank."""
    sizes = layout.sizes
    wanted = [("tp", sizes["tp"] > 1), ("cp", sizes["cp"] > 1), ("dp", sizes["dp"] > 1),
              ("dp-cp", sizes["cp"] > 1 and sizes["dp"] > 1), ("pp", sizes["pp"] > 1),
              ("embedding", sizes["pp"] > 1)]
    if expert_side_differs(layout):
        wanted += [("ep", sizes["ep"] > 1), ("etp", sizes["etp"] > 1 and layout.etp != layout.tp),
                   ("edp", sizes["edp"] > 1)]
    return [(f"{name} group" if name != "embedding" else "embedding", name)
            for name, keep in wanted if keep]


def virtual_stages(layout: RankLayout, vpp: int | None, pp_rank: int) -> list[int]:
    """Model chunks held by pipeline rank ``pp_rank``: virtual stage c·pp + pp_rank, c < vpp."""
    return [chunk * layout.pp + pp_rank for chunk in range(vpp or 1)]


def _render(rows: list[list[str]], split: int) -> list[str]:
    """Align ``rows`` (row 0 = header) in columns; a bar after the first ``split`` columns."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]

    def line(cells):
        left = "  ".join(c.rjust(w) for c, w in zip(cells[:split], widths[:split]))
        right = "  ".join(c.ljust(w) for c, w in zip(cells[split:], widths[split:]))
        return f" {left} │ {right}".rstrip()

    rule = "─" * (sum(widths[:split]) + 2 * (split - 1) + 2) + "┼" + "─" * (
        sum(widths[split:]) + 2 * max(len(widths) - split - 1, 0) + 1)
    return [line(rows[0]), rule] + [line(row) for row in rows[1:]]


def format_summary(layout: RankLayout, vpp: int | None = None) -> str:
    """Two lines: how the world factorises, for dense and (if different) expert layers."""
    lines = [f"tpfuse layout: {layout.world_size} ranks = tp {layout.tp} × cp {layout.cp} × "
             f"dp {layout.dp} × pp {layout.pp}"
             + (f" (× vpp {vpp} model chunks per rank)" if vpp else "")
             + f", order {layout.order} (fastest-varying first)"]
    if expert_side_differs(layout):
        lines.append(f"expert layers: {layout.world_size} ranks = etp {layout.etp} × "
                     f"ep {layout.ep} × edp {layout.edp} × pp {layout.pp}")
    return "\n".join(lines)


def format_layout_table(layout: RankLayout, vpp: int | None = None) -> str:
    """Every rank's coordinates and its groups, one row per global rank, plus all groups."""
    coords = _coordinate_columns(layout)
    groups = _group_columns(layout)
    header = ["rank"] + coords + (["chunks"] if vpp else []) + [h for h, _ in groups]
    rows = [header]
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        row = [f"R{rank}"] + [str(c[name]) for name in coords]
        if vpp:
            row.append(format_group(virtual_stages(layout, vpp, c["pp"])))
        row += [format_group(layout.group_view(name, rank)) for _, name in groups]
        rows.append(row)
    split = 1 + len(coords) + (1 if vpp else 0)
    parts = [format_summary(layout, vpp),
             "Rn = global rank n; tp/pp/dp/... = its rank inside each group; "
             "'x group' = the global ranks of its x group", ""] + _render(rows, split)
    parts += ["", format_all_groups(layout)]
    return "\n".join(parts)


def format_all_groups(layout: RankLayout) -> str:
    """Every group kind with more than one rank; kinds equal to an earlier one say so."""
    lines = ["groups (global ranks, in group-rank order):"]
    seen: dict[str, str] = {}
    width = max(len(name) for name in GROUP_NAMES)
    role_width = max(len(role) for role in GROUP_ROLES.values())
    for name in GROUP_NAMES:
        groups = layout.groups(name)
        if max(len(g) for g in groups) == 1:
            continue
        text = " ".join(format_group(g) for g in groups)
        label = f"  {name.ljust(width)}  {GROUP_ROLES[name].ljust(role_width)}  "
        if text in seen:
            lines.append(f"{label}= {seen[text]}")
            continue
        seen[text] = name
        if len(groups) > MAX_LISTED_MEMBERS:
            text = " ".join(format_group(g) for g in groups[:4]) + f" … ({len(groups)} groups)"
        lines.append(label + text)
    if len(lines) == 1:
        lines.append("  (every group is a single rank)")
    return "\n".join(lines)


def format_rank(layout: RankLayout, rank: int, vpp: int | None = None) -> str:
    """One rank in detail: its coordinates and, for every group kind, its group and position."""
    c = layout.coords(rank)
    lines = [f"R{rank}: " + ", ".join(f"{name} {c[name]}" for name in
                                     ("tp", "pp", "dp", "cp", "ep", "etp", "edp"))]
    pipe = layout.group_view("pp", rank)
    stage = pipe.index(rank)
    role = ("first and last stage" if len(pipe) == 1 else "first stage" if stage == 0
            else "last stage" if stage == len(pipe) - 1 else "middle stage")
    lines.append(f"  pipeline: {role}; next R{pipe[(stage + 1) % len(pipe)]}, "
                 f"previous R{pipe[(stage - 1) % len(pipe)]}"
                 + (f"; model chunks (virtual stages) {virtual_stages(layout, vpp, stage)}"
                    if vpp else ""))
    width = max(len(name) for name in GROUP_NAMES)
    for name in GROUP_NAMES:
        group = layout.group_view(name, rank)
        where = "not a member" if group is None else \
            f"rank {group.index(rank)} of {len(group)}"
        lines.append(f"  {name.ljust(width)}  {format_group(group):<20} {where:<14}  "
                     f"{GROUP_ROLES[name]}")
    return "\n".join(lines)


def format_batch(layout: RankLayout, global_batch_size: int, micro_batch_size: int,
                 vpp: int | None = None) -> str:
    """Global batch = micro × m × dp, and the pipeline bubble for 1F1B (and interleaved)."""
    calc = MicrobatchCalculator(global_batch_size, micro_batch_size, layout.dp)
    m = calc.num_microbatches
    lines = [f"batches: global {global_batch_size} = micro-batch {micro_batch_size} × "
             f"m {m} micro-batches × dp {layout.dp}"]

    def bubble_line(label, v):
        exact = Fraction(layout.pp - 1, v * m + layout.pp - 1)
        return (f"  {label}: (pp−1)/({'vpp·' if v > 1 else ''}m+pp−1) = {exact} = "
                f"{bubble_fraction(layout.pp, m, v):.1%} of each step idle")

    lines.append(bubble_line(f"1F1B bubble (pp {layout.pp}, m {m})", 1))
    if vpp and vpp > 1:
        lines.append(bubble_line(f"interleaved bubble (vpp {vpp})", vpp))
    if layout.pp > 1 and m < layout.pp:
        lines.append(f"  note: m {m} < pp {layout.pp}: some stages never work concurrently; "
                     f"use m ≥ pp (ideally m ≫ pp)")
    return "\n".join(lines)


def draw_rank_grid(layout: RankLayout, path: str, vpp: int | None = None) -> None:
    """Save a PNG: one row per pipeline stage, one cell per rank, coloured by data-parallel
    replica; tensor-parallel groups are boxed. Columns follow (tp, cp, dp), tp fastest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    cols = layout.tp * layout.cp * layout.dp
    fig_w = min(max(2.0 + 1.25 * cols, 6.5), 40.0)
    fig, ax = plt.subplots(figsize=(fig_w, 1.6 + 1.1 * layout.pp))
    cmap = plt.get_cmap("tab10" if layout.dp <= 10 else "viridis")
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        x = c["tp"] + layout.tp * (c["cp"] + layout.cp * c["dp"])
        y = layout.pp - 1 - c["pp"]
        colour = cmap(c["dp"] % 10 if layout.dp <= 10 else c["dp"] / max(layout.dp - 1, 1))
        ax.add_patch(Rectangle((x + 0.05, y + 0.08), 0.9, 0.84, facecolor=colour, alpha=0.55,
                               edgecolor="white"))
        label = f"R{rank}\ntp{c['tp']} dp{c['dp']}" + (f" cp{c['cp']}" if layout.cp > 1 else "")
        ax.text(x + 0.5, y + 0.5, label, ha="center", va="center", fontsize=9)
    for x0 in range(0, cols, layout.tp):  # one box per tensor-parallel group (adjacent columns)
        for y in range(layout.pp):
            ax.add_patch(Rectangle((x0 + 0.02, y + 0.04), layout.tp - 0.04, 0.92, fill=False,
                                   edgecolor="black", linewidth=1.6))
    ax.set_xlim(0, cols)
    ax.set_ylim(0, layout.pp)
    ax.set_yticks([layout.pp - 1 - s + 0.5 for s in range(layout.pp)])
    ax.set_yticklabels([f"stage {s}" + (f"\nchunks {virtual_stages(layout, vpp, s)}" if vpp
                                        else "") for s in range(layout.pp)])
    ax.set_xticks([])
    ax.set_frame_on(False)
    ax.set_title(f"{layout.world_size} ranks: tp {layout.tp} × cp {layout.cp} × dp {layout.dp} × "
                 f"pp {layout.pp}  (order {layout.order})\n"
                 f"rows = pipeline stages, boxes = TP groups, colour = DP replica", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
