"""``tpfuse-layout``'s rank table at 4,096 and 16,384 ranks: the group lookup per (rank, column).

Two ways of finding a rank's group, in the same run:

- ``indexed`` (tpfuse): ``RankLayout.group_view`` — one O(world) pass per group kind builds a
  rank → group table, then O(1) per lookup, so the whole table is linear in the world size;
- ``search`` (the peer: what the table did before): scan every group of the kind for the rank,
  O(world) per lookup, so the table is quadratic.

The benchmark times ``format_layout_table`` itself for the indexed way, and the bare lookups of the
table's columns for both ways (the search is too slow to time inside the full table at 16,384).
Run (pytest.ini disables benchmarks; ``-s`` prints the ratios)::

    python3 -m pytest benchmarks/test_bench_layout_table.py --benchmark-enable -q -s \\
        --benchmark-columns=median,min,rounds -p no:cacheprovider
"""
import time

import pytest

from tpfuse.parallel.layout import RankLayout
from tpfuse.parallel.report import format_layout_table

COLUMNS = ("tp", "dp", "pp", "embedding")
_TIMES: dict = {}


def _search(layout, name, rank):
    for group in layout.groups(name):
        if rank in group:
            return group
    return None


def _lookups(layout, find):
    for rank in range(layout.world_size):
        for name in COLUMNS:
            find(layout, name, rank)


@pytest.mark.parametrize("world", [4096, 16384])
def test_layout_table(benchmark, world):
    benchmark.group = "tpfuse-layout table"
    layout = RankLayout(world, tp=2, pp=2)
    benchmark.pedantic(format_layout_table, args=(layout,), rounds=3, iterations=1)
    start = time.perf_counter()
    _lookups(layout, RankLayout.group_view)
    indexed = time.perf_counter() - start
    start = time.perf_counter()
    if world <= 4096:
        _lookups(layout, _search)
        searched = time.perf_counter() - start
        print(f"\nworld {world}: lookups indexed {indexed:.3f} s, searched {searched:.2f} s, "
              f"search / indexed = {searched / indexed:.0f}x")
    _TIMES[world] = benchmark.stats.stats.median
    if len(_TIMES) == 2:
        print(f"full table: {_TIMES[4096]:.2f} s at 4,096 ranks, {_TIMES[16384]:.2f} s at 16,384 "
              f"(x{_TIMES[16384] / _TIMES[4096]:.1f} for 4x the ranks: linear)")
