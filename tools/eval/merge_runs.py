#!/usr/bin/env python3
"""Merges many `fluxion eval tasks --json` results (e.g. one process per sample on a many-core
machine, `tools/device/run.sh eval`) into one result file and one per-sample log.

Rows of the same (context, task, policy) whose seed ranges follow each other become one row:
correct, samples and paired lost/gained add up; accuracy and its Wilson interval, the paired
difference and its interval are recomputed (the rules `fluxion eval tasks` prints); read, guard
read, scored, bypass, prefill and tpot are sample-weighted means; the guard's checks and
escalations add up; the guard's error quantiles are dropped from joined rows. Rows with a gap
between their seeds stay separate (paired_table.py pools them). Overlapping seeds are refused. The header is the first file's, with
`merged_runs` (how many files) and the per-sample command as `unit_command`; the runs' per-sample
records (`samples`, what `fluxion eval compare` reads) are concatenated, and runs of different
`device`s are refused. With --log, the
per-sample lines of the runs' .txt logs (same path, .txt for .json) are written there, sorted by
(context, task, seed), for pair_policies.py.

    tools/eval/merge_runs.py OUT.json RUN.json [RUN.json ...] [--log OUT.txt] [--command CMD]
"""
import argparse
import json
import os
import re
import sys

from paired_stats import paired_difference95, wilson95

SAMPLE_LINE = re.compile(r"\[\d+/\d+\] (\S+) (\d+) seed (\d+): ")


# Per-sample means (weighted by samples), counts (added) and per-run quantiles (dropped when runs
# are joined) of a result row; every other field is the first run's.
MEANS = ("budget_spent", "prefill_ms", "tpot_ms", "guard_read", "scored", "bypassed")
SUMS = ("correct", "samples", "paired_lost", "paired_gained", "guard_checks", "guard_escalations",
        "degenerate_samples")
QUANTILES = ("guard_error_p50", "guard_error_p90")


def merge_rows(rows):
    groups = {}
    for r in rows:
        groups.setdefault((r["context"], r["task"], r["policy"]), []).append(r)
    merged = []
    for key, group in groups.items():
        group.sort(key=lambda r: r["seed"])
        runs = [dict(group[0])]
        for r in group[1:]:
            last = runs[-1]
            end = last["seed"] + last["samples"]
            if r["seed"] < end:
                sys.exit(f"error: {key}: seeds {r['seed']}-{r['seed'] + r['samples'] - 1} "
                         f"overlap {last['seed']}-{end - 1}")
            if r["seed"] > end:
                runs.append(dict(r))
                continue
            n0, n1 = last["samples"], r["samples"]
            for k in MEANS:
                if k in last and k in r:
                    last[k] = (last[k] * n0 + r[k] * n1) / (n0 + n1)
            for k in SUMS:
                if k in last and k in r:
                    last[k] += r[k]
            # Quantiles of the runs' checked-head errors do not combine into the pool's.
            for k in QUANTILES:
                last.pop(k, None)
        for r in runs:
            r["accuracy"] = r["correct"] / r["samples"]
            r["ci_low"], r["ci_high"] = wilson95(r["correct"], r["samples"])
            r["delta_vs_first"], r["delta_ci_low"], r["delta_ci_high"] = paired_difference95(
                r["paired_lost"], r["paired_gained"], r["samples"])
        merged.extend(runs)
    merged.sort(key=lambda r: (r["context"], r["task"], r["seed"]))
    return merged


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--log", help="also write the runs' per-sample log lines here")
    ap.add_argument("--command", help="the command that produced the runs (header `command`)")
    args = ap.parse_args()
    header, rows, lines, samples = None, [], [], []
    for path in args.runs:
        try:
            with open(path) as f:
                doc = json.load(f)
            rows.extend(doc["results"])
        except (OSError, ValueError, KeyError) as e:
            sys.exit(f"error: {path}: not a `fluxion eval tasks --json` file ({e})")
        if header is None:
            header = {k: v for k, v in doc.items() if k not in ("results", "samples")}
        # Files written before --device have no device: the cpu path.
        if doc.get("device", "cpu") != header.get("device", "cpu"):
            sys.exit(f"error: {path}: device {doc.get('device', 'cpu')}, but the first run's is "
                     f"{header.get('device', 'cpu')}")
        samples.extend(doc.get("samples", []))
        if args.log:
            log = os.path.splitext(path)[0] + ".txt"
            try:
                with open(log) as f:
                    lines.extend(l.rstrip("\n") for l in f if SAMPLE_LINE.match(l))
            except OSError as e:
                sys.exit(f"error: {log}: {e} (--log needs each run's .txt beside its .json)")
    header["unit_command"] = header.get("command", "")
    if args.command:
        header["command"] = args.command
    header["merged_runs"] = len(args.runs)
    header["results"] = merge_rows(rows)
    if samples:
        header["samples"] = samples
    with open(args.out, "w") as f:
        json.dump(header, f, indent=1, sort_keys=True)
        f.write("\n")
    if args.log:
        def key(line):
            m = SAMPLE_LINE.match(line)
            return int(m.group(2)), m.group(1), int(m.group(3))
        lines.sort(key=key)
        with open(args.log, "w") as f:
            f.write("\n".join(lines) + "\n")
    print(f"{args.out}: {len(header['results'])} rows from {len(args.runs)} runs")


if __name__ == "__main__":
    main()
