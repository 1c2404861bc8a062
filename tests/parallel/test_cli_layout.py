"""tpfuse-layout: the printed table, --rank, --json, --png, batch arithmetic and error exits.

The table is parsed back and compared with RankLayout (hand-checked in test_layout.py); the seed
example's rows are also checked against DESIGN.md's R0/R3/R6.
"""
import json
import subprocess
import sys

import pytest

from tpfuse.parallel.cli import format_layout_table, main
from tpfuse.parallel.layout import RankLayout
from tpfuse.parallel.report import format_group


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _table_rows(text: str) -> tuple[list[str], dict[int, list[str]]]:
    """Header cells and the cells of every 'Rn' row of the rank table."""
    lines = text.splitlines()
    header_line = next(line for line in lines if line.strip().startswith("rank"))
    left, right = header_line.split("│")
    header = left.split() + [h.strip() for h in right.split("  ") if h.strip()]
    rows = {}
    for line in lines:
        cells = line.replace("│", " ").split()
        if cells and cells[0].startswith("R") and cells[0][1:].isdigit() and len(cells) > 2:
            rows[int(cells[0][1:])] = cells
    return header, rows


def test_seed_example_table_matches_design_doc(capsys):
    code, out, err = _run(capsys, "--world-size", "8", "--tp", "2", "--pp", "2")
    assert code == 0 and err == ""
    header, rows = _table_rows(out)
    assert header[:4] == ["rank", "tp", "pp", "dp"]
    # DESIGN.md: R0 = tp0 pp0 dp0, R3 = tp1 pp0 dp1, R6 = tp0 pp1 dp1
    assert rows[0][1:4] == ["0", "0", "0"]
    assert rows[3][1:4] == ["1", "0", "1"]
    assert rows[6][1:4] == ["0", "1", "1"]
    assert sorted(rows) == list(range(8))


@pytest.mark.parametrize("argv, sizes", [
    (["--tp", "2", "--pp", "2"], dict(tp=2, pp=2)),
    (["--tp", "2", "--pp", "2", "--cp", "2"], dict(tp=2, pp=2, cp=2)),
    (["--tp", "2", "--ep", "2", "--etp", "1"], dict(tp=2, ep=2, etp=1)),
    (["--tp", "2", "--pp", "2", "--order", "tp-pp-dp"], dict(tp=2, pp=2, order="tp-pp-dp")),
])
def test_every_row_matches_rank_layout(capsys, argv, sizes):
    code, out, _ = _run(capsys, "--world-size", "8", *argv)
    assert code == 0
    layout = RankLayout(8, **sizes)
    header, rows = _table_rows(out)
    for rank in range(8):
        coords = layout.coords(rank)
        cells = dict(zip(header, rows[rank]))
        assert cells.pop("rank") == f"R{rank}"
        assert len(cells) == len(header) - 1
        for column, value in cells.items():
            if column in coords:
                assert value == str(coords[column]), (rank, column)
            elif column.endswith(" group"):
                name = column[: -len(" group")]
                assert value == format_group(layout.group_of(name, rank)), (rank, column)
            elif column == "embedding":
                assert value == format_group(layout.group_of("embedding", rank))
    assert out.rstrip().endswith(format_layout_table(layout).rstrip().splitlines()[-1])


def test_groups_section_lists_each_kind_once(capsys):
    _, out, _ = _run(capsys, "--world-size", "8", "--tp", "2", "--pp", "2")
    section = out[out.index("groups (global ranks"):].splitlines()
    by_name = {line.split()[0]: line for line in section[1:]}
    assert by_name["pp"].endswith("[0,4] [1,5] [2,6] [3,7]")
    assert by_name["tp-pp"].endswith("[0,1,4,5] [2,3,6,7]")
    assert by_name["edp"].endswith("= dp")  # expert DP equals DP when etp = tp and ep = 1
    assert "position-embedding" not in by_name  # single-rank groups are left out


def test_rank_detail(capsys):
    code, out, _ = _run(capsys, "--world-size", "8", "--tp", "2", "--pp", "2", "--rank", "3")
    assert code == 0
    assert "R3: tp 1, pp 0, dp 1, cp 0, ep 0, etp 1, edp 1" in out
    assert "first stage; next R7, previous R7" in out
    line = next(line for line in out.splitlines() if line.strip().startswith("tp-pp "))
    assert "[2,3,6,7]" in line and "rank 1 of 4" in line


def test_batch_arithmetic_and_bubble(capsys):
    code, out, _ = _run(capsys, "--world-size", "8", "--tp", "2", "--pp", "2", "--vpp", "2",
                        "--global-batch-size", "16", "--micro-batch-size", "1")
    assert code == 0
    assert "global 16 = micro-batch 1 × m 8 micro-batches × dp 2" in out
    assert "= 1/9 = 11.1%" in out    # 1F1B: (2-1)/(8+2-1)
    assert "= 1/17 = 5.9%" in out    # interleaved: (2-1)/(2·8+2-1)
    assert "chunks" in out and "[0,2]" in out and "[1,3]" in out  # virtual stages per rank


def test_json_is_to_dict(capsys):
    code, out, _ = _run(capsys, "--world-size", "8", "--tp", "2", "--pp", "2", "--json")
    assert code == 0
    assert json.loads(out) == RankLayout(8, tp=2, pp=2).to_dict()
    code, out, _ = _run(capsys, "--world-size", "8", "--pp", "2", "--json",
                        "--global-batch-size", "32", "--micro-batch-size", "2")
    batch = json.loads(out)["batch"]
    assert batch["num_microbatches"] == 4 and batch["bubble_fraction"] == pytest.approx(1 / 5)


def test_png_draws_the_rank_grid(capsys, tmp_path):
    import matplotlib.image

    path = tmp_path / "grid.png"
    code, out, _ = _run(capsys, "--world-size", "8", "--tp", "2", "--pp", "2", "--png",
                        str(path))
    assert code == 0 and f"rank grid written to {path}" in out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(str(path))
    height, width = image.shape[:2]
    assert width > 400 and height > 200
    colours = {tuple((pixel[:3] * 20).round()) for row in image[::7] for pixel in row[::7]}
    assert len(colours) >= 4  # white background, black boxes, two DP-replica colours


@pytest.mark.parametrize("argv, words", [
    (["--world-size", "8", "--tp", "3"], ["world_size=8", "tp*pp*cp=3"]),
    (["--world-size", "8", "--tp", "2", "--pp", "2", "--order", "tp-dp"], ["lacks 'pp'"]),
    (["--world-size", "8", "--order", "tp-zz"], ["'zz'"]),
    (["--world-size", "8", "--ep", "3"], ["etp*ep*pp=3"]),
    (["--world-size", "8", "--vpp", "2"], ["vpp=2", "pp=1"]),
    (["--world-size", "8", "--rank", "8"], ["--rank", "8"]),
    (["--world-size", "0"], ["world_size", "0"]),
    (["--world-size", "8", "--tp", "2", "--global-batch-size", "10", "--micro-batch-size", "2"],
     ["--global-batch-size 10", "--micro-batch-size 2", "dp 4"]),
    (["--world-size", "8", "--global-batch-size", "0"], ["--global-batch-size", "0"]),
    (["--world-size", "8", "--micro-batch-size", "2"], ["--micro-batch-size needs"]),
    (["--world-size", "eight"], ["--world-size", "invalid int value"]),
    (["--tp", "2"], ["--world-size"]),
])
def test_bad_input_exits_2_with_a_message(capsys, argv, words):
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    assert "Traceback" not in err and err.startswith(("tpfuse-layout: error", "usage:"))
    for word in words:
        assert word in err, (word, err)


def test_unwritable_png_exits_2(capsys, tmp_path):
    code, out, err = _run(capsys, "--world-size", "4", "--png", str(tmp_path / "no" / "a.png"))
    assert code == 2 and "--png" in err and out == ""


def test_console_script_entry_point():
    # the installed entry point (tpfuse.parallel.cli:main) via its module; exit status passes
    ok = subprocess.run([sys.executable, "-m", "tpfuse.parallel.cli", "--world-size", "8",
                         "--tp", "2", "--pp", "2"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "R7" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "tpfuse.parallel.cli", "--world-size", "8",
                          "--tp", "3"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "tp*pp*cp=3" in bad.stderr and "Traceback" not in bad.stderr
