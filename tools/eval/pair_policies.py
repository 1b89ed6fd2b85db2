#!/usr/bin/env python3
"""Paired difference of two policies over the same prompts, from `fluxion eval tasks` logs.

paired_table.py pairs every policy with the first one of its own run. This pairs any two
policies, also across runs (the prompt of a (task, seed) is the same in every run), from the
per-sample lines the command prints ("[i/n] TASK CONTEXT seed S: policy=ok|wrong ..."). LOG:POLICY,..
takes only those policies from LOG (e.g. exact_topk from an older run whose history-policy rows
predate a change); a (task, seed, policy) found in two logs is refused.

    tools/eval/pair_policies.py fluxion@0.02 exact_topk@0.02 NEW.txt OLD.txt:exact_topk@0.02 \
        [--tasks niah_single,...]
"""
import argparse
import math
import re
import sys

LINE = re.compile(r"\[\d+/\d+\] (\S+) (\d+) seed (\d+): (.*?) \(prefill")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--tasks", help="comma list: only these tasks")
    args = ap.parse_args()
    tasks = set(args.tasks.split(",")) if args.tasks else None
    outcome = {}  # (task, context, seed, policy) -> True if correct
    for arg in args.logs:
        path, _, only = arg.partition(":")
        keep = set(only.split(",")) if only else None
        try:
            lines = open(path).read().splitlines()
        except OSError as e:
            sys.exit(f"error: {e}")
        for line in lines:
            m = LINE.match(line)
            if not m:
                continue
            for item in m.group(4).split():
                policy, _, result = item.partition("=")
                if keep is not None and policy not in keep:
                    continue
                key = (m.group(1), m.group(2), m.group(3), policy)
                if key in outcome:
                    sys.exit(f"error: {path}: {policy} {m.group(1)} seed {m.group(3)} is also in "
                             "an earlier log")
                outcome[key] = result == "ok"
    diffs = []
    for (task, context, seed, policy), ok in outcome.items():
        if policy != args.a or (tasks and task not in tasks):
            continue
        other = outcome.get((task, context, seed, args.b))
        if other is not None:
            diffs.append(int(ok) - int(other))
    n = len(diffs)
    if n < 2:
        sys.exit(f"error: {n} prompts hold both {args.a} and {args.b}")
    mean = sum(diffs) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    half = 1.96 * sd / math.sqrt(n)
    print(f"{args.a} vs {args.b}: {n} prompts, only {args.a} right {diffs.count(1)}, only "
          f"{args.b} right {diffs.count(-1)}, difference {100 * mean:+.1f} points "
          f"[{100 * (mean - half):+.1f}, {100 * (mean + half):+.1f}] (95%)")


if __name__ == "__main__":
    main()
