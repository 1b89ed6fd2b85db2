#!/usr/bin/env python3
"""Speed-vs-accuracy frontier: every policy's decode step against its paired accuracy change.

Speed comes from `fluxion bench decode --device cuda --json` files (one batch and context point,
--batch / --context), accuracy from `fluxion eval tasks --json` files: each policy's paired
difference against full attention (the file's first policy) pooled over tasks, with its 95%
interval (tools/eval/paired_stats.py). A policy label is the eval's (`fluxion@0.05`,
`fixed_32_0.02`, `exact_topk@0.05+device`); a decode row's label drops its decision profile and
zero-copy share (`fluxion@0.05+device/tiny-retrieval-16k/zc0.5` -> `fluxion@0.05+device`).

Accuracy files are read in order and the first one holding a policy gives its accuracy (list the
largest run first), so every point's interval is over one run's paired prompts. Prints a markdown
table (step, reads, accuracy change, the file each came from) and, with --out, draws the plot
(matplotlib, Debian's python3-matplotlib).

    tools/eval/frontier.py --speed DECODE.json [MORE.json] --accuracy EVAL.json [MORE.json] \
        [--batch 1] [--context 131072] [--accuracy-context 4096] [--out frontier.svg]
"""
import argparse
import json
import os
import sys

from paired_stats import paired_difference95


def speed_label(policy):
    """A decode row's policy label as the eval names it."""
    label = policy.split("/")[0]
    return {"hbm-full": "full (KV in HBM)", "full": "full (host KV)"}.get(label, label)


def load_speed(paths, batch, context):
    """label -> (step ms, host rows per step, file); the first file holding a label wins."""
    out = {}
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        for r in doc["results"]:
            if r.get("batch") != batch or r.get("context") != context or "step_ms" not in r:
                continue
            label = speed_label(r["policy"])
            if label == "resident-only" or label in out:
                continue
            # Rows read from host memory: the CPU's and the GPU's zero-copy share.
            rows = None
            if "host_rows_per_step" in r:
                rows = r["host_rows_per_step"] + r.get("device_read_rows_per_step", 0)
            out[label] = (r["step_ms"], rows, os.path.basename(path))
    return out


def load_accuracy(paths, context):
    """label -> (delta, low, high, prompts, file): pooled paired outcomes against full."""
    out = {}
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        pooled = {}
        for r in doc["results"]:
            if r["context"] != context:
                continue
            p = pooled.setdefault(r["policy"], [0, 0, 0])
            p[0] += r["paired_lost"]
            p[1] += r["paired_gained"]
            p[2] += r["samples"]
        for label, (lost, gained, n) in pooled.items():
            if label in out or n == 0:
                continue
            delta, low, high = paired_difference95(lost, gained, n)
            out[label] = (100 * delta, 100 * low, 100 * high, n, os.path.basename(path))
    return out


def accuracy_of(label, accuracy):
    """The label's accuracy; a full-attention row is the reference (0)."""
    if label.startswith("full"):
        return (0.0, 0.0, 0.0, None, "reference")
    return accuracy.get(label)


def rows(speed, accuracy):
    out = []
    for label, (ms, host_rows, speed_file) in sorted(speed.items(), key=lambda x: x[1][0]):
        acc = accuracy_of(label, accuracy)
        out.append({"policy": label, "step_ms": ms, "host_rows": host_rows,
                    "speed_file": speed_file, "accuracy": acc})
    return out


def print_table(table, batch, context, accuracy_context):
    print(f"| policy | step ms ({batch} x {context // 1024}K) | host rows a step | "
          f"accuracy vs full, points [95%] ({accuracy_context // 1024}K) | prompts | files |")
    print("|---|---|---|---|---|---|")
    for r in table:
        acc = r["accuracy"]
        if acc is None:
            cell, n, files = "not measured", "", r["speed_file"]
        else:
            cell = f"{acc[0]:+.1f} [{acc[1]:+.1f}, {acc[2]:+.1f}]"
            n = "" if acc[3] is None else str(acc[3])
            files = r["speed_file"] + ("" if acc[3] is None else ", " + acc[4])
        host = "" if r["host_rows"] is None else f"{r['host_rows']:.0f}"
        print(f"| {r['policy']} | {r['step_ms']:.2f} | {host} | {cell} | {n} | {files} |")


def plot(table, out, batch, context, accuracy_context):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Two panels over one x axis: the accurate policies within a few points of full (top), and
    # the whole range (bottom), where the fixed baselines sit tens of points lower.
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(10, 7.5),
                                      gridspec_kw={"height_ratios": [3, 1]})
    hbm = next((r["step_ms"] for r in table if r["policy"] == "full (KV in HBM)"), None)
    for ax in (top, bottom):
        if hbm is not None:
            ax.axvline(hbm, color="grey", linestyle=":", linewidth=1)
        ax.axhline(0, color="grey", linewidth=0.8)
        ax.grid(True, which="both", alpha=0.3)
    top.axhline(-0.5, color="grey", linestyle="--", linewidth=0.8)
    if hbm is not None:
        top.text(hbm, 1.2, " full attention, KV in HBM", color="grey", fontsize=8)
    top.set_ylim(-6.5, 2)
    shown = 0
    for r in table:
        acc = r["accuracy"]
        if acc is None or r["policy"] == "full (KV in HBM)":
            continue
        name = r["policy"]
        family = name.split("@")[0].split("_0")[0]
        color = {"fluxion": "tab:red", "lfps": "tab:orange", "exact_topk": "tab:purple",
                 "quest": "tab:blue", "fixed_32": "tab:green"}.get(family, "black")
        marker = "o" if "+device" in name else ("s" if family in ("fluxion", "lfps",
                                                                   "exact_topk") else "^")
        for ax in (top, bottom):
            ax.errorbar(r["step_ms"], acc[0], yerr=[[acc[0] - acc[1]], [acc[2] - acc[0]]],
                        fmt=marker, color=color, capsize=3, markersize=6)
        ax = top if acc[0] > -6.5 else bottom
        # Neighbours alternate above and below their point so their labels do not overlap.
        dy = 10 if shown % 2 == 0 else -14
        ax.annotate(name, (r["step_ms"], acc[0]), textcoords="offset points", xytext=(4, dy),
                    fontsize=7, color=color)
        shown += 1
    bottom.set_xscale("log")
    bottom.set_xlabel(f"decode step, ms ({batch} x {context // 1024}K, Llama-3.1-8B shapes, KV "
                      "in host memory; log scale)")
    top.set_ylabel(f"points vs full ({accuracy_context // 1024}K, paired, 95%)")
    bottom.set_ylabel("whole range")
    top.set_title("Speed against accuracy: up and to the left is better (circles: selection on "
                  "the GPU; dashed: -0.5 points)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--speed", nargs="+", required=True)
    ap.add_argument("--accuracy", nargs="+", required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--accuracy-context", type=int, default=4096)
    ap.add_argument("--out", help="also draw the plot into this file (.svg or .png)")
    args = ap.parse_args()
    try:
        speed = load_speed(args.speed, args.batch, args.context)
        accuracy = load_accuracy(args.accuracy, args.accuracy_context)
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"error: {e}")
    if not speed:
        sys.exit(f"error: no decode rows at batch {args.batch}, context {args.context}")
    table = rows(speed, accuracy)
    print_table(table, args.batch, args.context, args.accuracy_context)
    if args.out:
        plot(table, args.out, args.batch, args.context, args.accuracy_context)


if __name__ == "__main__":
    main()
