#!/usr/bin/env python3
"""Markdown table of a `fluxion eval tasks --json` result: one row per policy, one column per task.

Each task cell is correct/n with the paired outcome against the first policy (full attention when
it is listed first): (-lost/+gained). The "all" columns pool every sample of the context: paired
lost/gained and the mean paired difference with a normal-approximation 95% interval (the same
rule `fluxion eval tasks` prints per task).

Several files are pooled when they hold disjoint samples (runs with different --seed ranges):
correct counts, sample counts and paired lost/gained add up exactly, reads by sample weight.
Policies missing from some files are shown with the samples they have. FILE:POLICY,POLICY takes
only those policies from FILE (e.g. an older run whose `lfps` rows predate a change to it but
whose `full` and `exact_topk` rows still hold); overlapping seed ranges of one policy are refused.

    tools/eval/paired_table.py RESULT.json[:full,exact_topk@0.02] [MORE.json ...] [--context 4096]
"""
import argparse
import json
import sys
from collections import OrderedDict

from paired_stats import paired_difference95


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json_files", nargs="+")
    ap.add_argument("--context", type=int, help="only this context (default: each, in turn)")
    ap.add_argument("--tasks", help="comma list: only these tasks (e.g. the ones that count: full "
                    "attention >= 0.8 at that length)")
    args = ap.parse_args()
    pooled = OrderedDict()
    seen = {}  # (context, task, policy) -> [(first seed, end), ...]
    for arg in args.json_files:
        path, _, only = arg.partition(":")
        keep = set(only.split(",")) if only else None
        try:
            with open(path) as f:
                doc = json.load(f)
            rows = doc["results"]
        except (OSError, ValueError, KeyError) as e:
            sys.exit(f"error: {path}: not a `fluxion eval tasks --json` file ({e})")
        for r in rows:
            if keep is not None and r["policy"] not in keep:
                continue
            key = (r["context"], r["task"], r["policy"])
            begin, end = r["seed"], r["seed"] + r["samples"]
            for b, e in seen.get(key, []):
                if begin < e and b < end:
                    sys.exit(f"error: {path}: {r['policy']} {r['task']} {r['context']} seeds "
                             f"{begin}-{end - 1} overlap {b}-{e - 1} from an earlier file")
            seen.setdefault(key, []).append((begin, end))
            p = pooled.setdefault(key, {"context": r["context"], "task": r["task"],
                                        "policy": r["policy"], "correct": 0, "samples": 0,
                                        "paired_lost": 0, "paired_gained": 0, "read_sum": 0.0})
            for k in ("correct", "samples", "paired_lost", "paired_gained"):
                p[k] += r[k]
            p["read_sum"] += r["budget_spent"] * r["samples"]
    rows = list(pooled.values())
    if args.tasks:
        wanted = args.tasks.split(",")
        rows = [r for r in rows if r["task"] in wanted]
    for r in rows:
        r["budget_spent"] = r["read_sum"] / max(r["samples"], 1)
    contexts = sorted({r["context"] for r in rows})
    if args.context is not None:
        if args.context not in contexts:
            sys.exit(f"error: context {args.context} not in the file (has {contexts})")
        contexts = [args.context]
    for context in contexts:
        cells = [r for r in rows if r["context"] == context]
        tasks = list(OrderedDict.fromkeys(r["task"] for r in cells))
        policies = list(OrderedDict.fromkeys(r["policy"] for r in cells))
        print(f"| policy ({context}) | " + " | ".join(tasks) +
              " | all: correct/n | lost/gained vs first | delta [95%] | read |")
        print("|---" * (len(tasks) + 5) + "|")
        for p in policies:
            line, correct, n, lost, gained, read, read_n = [], 0, 0, 0, 0, 0.0, 0
            for t in tasks:
                r = next((x for x in cells if x["task"] == t and x["policy"] == p), None)
                if r is None:
                    line.append("-")
                    continue
                cell = f"{r['correct']}/{r['samples']}"
                if r["paired_lost"] or r["paired_gained"]:
                    cell += f" (-{r['paired_lost']}/+{r['paired_gained']})"
                line.append(cell)
                correct += r["correct"]
                n += r["samples"]
                lost += r["paired_lost"]
                gained += r["paired_gained"]
                read += r["budget_spent"] * r["samples"]
                read_n += r["samples"]
            delta, low, high = paired_difference95(lost, gained, n)
            print(f"| {p} | " + " | ".join(line) +
                  f" | {correct}/{n} ({correct / max(n, 1):.3f}) | {lost}/{gained} | "
                  f"{delta:+.3f} [{low:+.3f}, {high:+.3f}] | "
                  f"{read / max(read_n, 1):.4f} |")
        print()


if __name__ == "__main__":
    main()
