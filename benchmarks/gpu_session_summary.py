"""summary.json and summary.md of a ``gpu_session.sh`` run, from OUTDIR/checks.tsv and the logs.

    python benchmarks/gpu_session_summary.py OUTDIR [--dry-run 0|1]

checks.tsv holds one row per check: name, exit status (or ``skip``), seconds, limit, reason.
Status: ``ok`` (exit 0), ``failed`` (any other exit status; 124 or 137: the limit ran out),
``skipped``. Key figures per check:

- ``train_tpfuse`` / ``train_peer`` (metrics JSONL in logs/): tokens/s, TFLOP/s and MFU as the
  median over the iterations after the first third (compilation and warm-up excluded), peak
  memory (MiB), the loss curve; ``train_peer`` adds ``tokens_per_s_ratio_tpfuse_to_peer``, the
  largest loss difference between the two curves (both start from the same weights) and
  ``compiled`` (False: eager, after ``torch.compile`` failed or with ``--no-compile``);
- ``train_tp2`` / ``train_pp2``: the largest |loss − loss of the 1-process run| over their
  iterations, the first ones of the same job and schedule (``losses_match``: within
  ``LOSS_TOLERANCE`` relative);
- ``gpu_check``: rows PASS / FAIL / ERROR / SKIPPED counted, every timed row's ratio;
- ``attention_masks`` / ``moe`` / ``context_parallel``: their verdict lines counted
  (``checks_passed``, ``checks_failed``: a table cell PASS / FAIL, or a line opening ``ok`` /
  ``FAIL``) and the log's last lines;
- ``generation``: its JSON line; every other check: its log's last lines.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys

# 2-process runs against the 1-process one: in fp32 (the dry run) the reduction order alone
# differs (≈1e-6 relative); in bf16 a few roundings of 2⁻⁸ each reach the loss: 2e-2 bounds both
LOSS_TOLERANCE = 2e-2
TAIL = 6
VERDICT = re.compile(r"(?:^|\|)\s*(PASS|FAIL|ok)(?:\s*\||\s*$|\s{2})")


def read_rows(out: str) -> list[dict]:
    rows = []
    with open(os.path.join(out, "checks.tsv")) as handle:
        for line in handle:
            if not line.strip():
                continue
            name, rc, seconds, limit, reason = (line.rstrip("\n").split("\t") + [""])[:5]
            status = "skipped" if rc == "skip" else "ok" if rc == "0" else "failed"
            row = {"name": name, "status": status, "seconds": int(seconds),
                   "limit_s": int(limit)}
            if rc not in ("0", "skip"):
                row["exit_status"] = int(rc)
                if rc in ("124", "137"):
                    row["reason"] = "limit reached"
            if reason:
                row["reason"] = reason
            rows.append(row)
    return rows


def metrics(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    return [r for r in records if r.get("loss") is not None and r.get("iteration", 0) > 0]


def training_figures(records: list[dict]) -> dict:
    if not records:
        return {}
    steady = records[len(records) // 3:] or records
    figures = {"iterations": len(records),
               "losses": [round(r["loss"], 5) for r in records]}
    for key in ("tokens_per_s", "tflops_per_rank", "mfu", "ms_per_iter"):
        values = [r[key] for r in steady if r.get(key) is not None]
        if values:
            figures[key] = float(f"{statistics.median(values):.4g}")
    if "compiled" in records[-1]:              # the peer: torch.compile, or eager after it failed
        figures["compiled"] = records[-1]["compiled"]
    peaks = [r["peak_memory_mib"] for r in records if r.get("peak_memory_mib") is not None]
    if peaks:
        figures["peak_memory_mib"] = round(max(peaks), 1)
    return figures


def largest_loss_difference(ours: list[float], theirs: list[float]) -> float | None:
    pairs = list(zip(ours, theirs))
    return max(abs(a - b) for a, b in pairs) if pairs else None


def gpu_check_figures(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as handle:
        table = json.load(handle)
    counts: dict = {}
    for row in table["rows"]:
        status = row["status"]
        if status:
            word = (f"goal {status.rsplit(':', 1)[-1].strip()}" if status.startswith("goal")
                    else status.split(" ")[0])        # PASS / FAIL / ERROR / SKIPPED / goal met
            counts[word] = counts.get(word, 0) + 1
    ratios = {f"{row['section']} {row['what']}": row["value"] for row in table["rows"]
              if row["value"].endswith("x") and row["ours"]}
    return {"statuses": counts, "ratios": ratios}


def last_json_line(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    for line in reversed(open(path).read().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return {}
    return {}


def verdicts(path: str) -> dict:
    """How many of the log's lines say PASS (or open with ``ok``) and how many FAIL."""
    counts = {"checks_passed": 0, "checks_failed": 0}
    if os.path.exists(path):
        for line in open(path, errors="replace").read().splitlines():
            found = VERDICT.search(line)
            if found:
                counts["checks_failed" if found.group(1) == "FAIL" else "checks_passed"] += 1
    return counts


def tail(path: str) -> list[str]:
    if not os.path.exists(path):
        return []
    return [line[:200] for line in open(path, errors="replace").read().splitlines()[-TAIL:]]


def figures_for(row: dict, logs: str, curves: dict) -> dict:
    name = row["name"]
    if name in ("train_tpfuse", "train_peer", "train_tp2", "train_pp2"):
        records = metrics(os.path.join(logs, f"{name}.jsonl"))
        figures = training_figures(records)
        curves[name] = figures.get("losses", [])
        reference = curves.get("train_tpfuse", [])
        if name == "train_peer" and figures:
            if "tokens_per_s" in curves.get("train_tpfuse_figures", {}):
                figures["tokens_per_s_ratio_tpfuse_to_peer"] = round(
                    curves["train_tpfuse_figures"]["tokens_per_s"] / figures["tokens_per_s"], 3)
            figures["largest_loss_difference_to_tpfuse"] = largest_loss_difference(
                reference, curves[name])
        if name in ("train_tp2", "train_pp2") and figures:
            difference = largest_loss_difference(reference, curves[name])
            figures["largest_loss_difference_to_1_process"] = difference
            figures["losses_match"] = (difference is not None and len(reference) >= len(curves[name])
                                       and difference <= LOSS_TOLERANCE * max(map(abs, reference)))
            if not figures["losses_match"] and row["status"] == "ok":
                row["status"], row["reason"] = "failed", "losses differ from the 1-process run"
        if name == "train_tpfuse":
            curves["train_tpfuse_figures"] = figures
        return figures
    if name == "gpu_check":
        return gpu_check_figures(os.path.join(logs, "gpu_check.json")) or {
            "log_tail": tail(os.path.join(logs, f"{name}.log"))}
    if name == "generation":
        return last_json_line(os.path.join(logs, f"{name}.log"))
    if name in ("attention_masks", "moe", "context_parallel"):
        return {**verdicts(os.path.join(logs, f"{name}.log")),
                "log_tail": tail(os.path.join(logs, f"{name}.log"))}
    return {"log_tail": tail(os.path.join(logs, f"{name}.log"))}


def short_figures(row: dict) -> str:
    """The table cell: the figures that answer the session's questions."""
    f = row.get("figures", {})
    parts = []
    for key, label in (("tokens_per_s", "tokens/s"), ("mfu", "MFU"),
                       ("peak_memory_mib", "peak MiB"),
                       ("tokens_per_s_ratio_tpfuse_to_peer", "tpfuse/peer"),
                       ("largest_loss_difference_to_tpfuse", "max Δloss vs tpfuse"),
                       ("largest_loss_difference_to_1_process", "max Δloss vs 1 process")):
        if f.get(key) is not None:
            value = f[key]
            parts.append(f"{label} {value:.3g}" if isinstance(value, float) else f"{label} {value}")
    if "losses" in f and f["losses"]:
        parts.append(f"loss {f['losses'][0]:.3f} → {f['losses'][-1]:.3f}")
    if "statuses" in f:
        parts.append(", ".join(f"{k} {v}" for k, v in sorted(f["statuses"].items())))
    if "checks_passed" in f:
        parts.append(f"checks passed {f['checks_passed']}, failed {f['checks_failed']}")
    if row["name"] == "generation" and "tokens_per_s" in f:
        parts.append(f"cache = recompute: {f.get('cache_matches_recompute')}")
    if f.get("log_tail"):
        parts.append(f"last line: {f['log_tail'][-1].strip()[:100]}".replace("|", "/"))
    if row.get("reason"):
        parts.append(row["reason"])
    return "; ".join(parts)


def markdown(summary: dict) -> str:
    lines = [f"GPU session ({'CPU dry run' if summary['dry_run'] else 'device'}): "
             f"{summary.get('versions', '')}", "",
             "| check | status | seconds (limit) | key figures |", "| --- | --- | --- | --- |"]
    for row in summary["checks"]:
        lines.append(f"| {row['name']} | {row['status']} | {row['seconds']} ({row['limit_s']}) "
                     f"| {short_figures(row)} |")
    ratios = {}
    for row in summary["checks"]:
        ratios.update(row.get("figures", {}).get("ratios", {}))
    if ratios:
        lines += ["", "| kernel timing | ours / torch |", "| --- | --- |"]
        lines += [f"| {what} | {value} |" for what, value in ratios.items()]
    return "\n".join(lines) + "\n"


def summarise(out: str, dry_run: bool) -> dict:
    logs = os.path.join(out, "logs")
    curves: dict = {}
    rows = read_rows(out)
    for row in rows:
        row["figures"] = figures_for(row, logs, curves) if row["status"] != "skipped" else {}
    versions = os.path.join(out, "versions.txt")
    summary = {"dry_run": dry_run, "limits_total_s": sum(r["limit_s"] for r in rows),
               "versions": open(versions).read().strip() if os.path.exists(versions) else "",
               "checks": rows}
    with open(os.path.join(out, "summary.json"), "w") as handle:
        json.dump(summary, handle, indent=1)
    with open(os.path.join(out, "summary.md"), "w") as handle:
        handle.write(markdown(summary))
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--dry-run", type=int, default=0)
    args = parser.parse_args(argv)
    summarise(args.out, bool(args.dry_run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
