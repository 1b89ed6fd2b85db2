#!/usr/bin/env python3
"""Unit list for tools/device/xeon_eval.sh (`tools/device/run.sh eval`): one line
"CONTEXT TASK SEED" per sample.

Seed-major order (every task's seed s before any task's seed s + 1), so that a run cut short by
the device budget still holds about as many samples of each task. Units already done (their
JSON in --done folders) are left out.

    tools/device/eval_units.py --contexts 16384 --samples 200 [--tasks T,...] [--done DIR ...] > units.txt

--tasks defaults to six tasks (run 4's weights had `vt` at chance); pass all seven for the
current weights (run 5), where every task counts.
"""
import argparse
import os

TASKS = ["passage", "aggregate", "niah_single", "niah_multikey", "niah_multivalue",
         "niah_multiquery"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="16384")
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1000000)
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--done", nargs="*", default=[])
    args = ap.parse_args()
    done = set()
    for d in args.done:
        for name in os.listdir(d):
            if name.endswith(".json"):
                done.add(name[: -len(".json")])
    for ctx in args.contexts.split(","):
        for i in range(args.samples):
            for task in args.tasks.split(","):
                unit = f"{ctx}-{task}-{args.seed + i}"
                if unit not in done:
                    print(ctx, task, args.seed + i)


if __name__ == "__main__":
    main()
