#!/usr/bin/env python3
"""How well compact key copies of each width rank a step's rows: top-k overlap and attention mass
against exact scores, on captured decode steps (`fluxion eval tasks --capture-dir DIR`).

Device selection (docs/SPARSE.md, "Device selection") scores every middle row of a (layer, KV
head) from a compact copy of K kept in HBM and keeps the k best. The width of that copy sets its
HBM bytes per token and the scan's time against how often it picks the rows exact scores would.
This measures the candidates side by side on the same captured queries and keys:

  int8-row   int8 values, one fp32 scale per row (what kernels/compact_keys.h stores: 132 B/row)
  int4-row   4-bit values (-7..7), one fp32 scale per row (68 B/row at head_dim 128)
  int4-g16   4-bit values, one fp16 scale per 16 values (80 B/row)

Queries are int8 with a per-head scale for every width (as the device quantizes them). The exact
score of row t is max over the group's query heads of q.k (K rounded to bf16, as the host pages
store it); a compact score is the same max over the quantized product. Per (sample, layer,
captured row, KV head): k = budget x middle rows; overlap = |compact top-k & exact top-k| / k;
mass = the softmax mass (the group's mean over the whole context) on the compact picks over the
mass on the exact picks.

    /usr/bin/python3 tools/eval/compact_bits.py --capture DIR [--budget 0.02,0.05] [--json OUT]
"""
import argparse
import json
import os

import numpy as np


def bf16(x):
    """Round float32 to bf16 (nearest even) and back, as the host pages store K."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = ((u >> 16) & 1) + 0x7FFF
    return ((u + r) & 0xFFFF0000).view(np.float32)


def quantize_rows(x, levels):
    """Symmetric per-row quantization of the last axis: (values, scales)."""
    absmax = np.abs(x).max(axis=-1, keepdims=True)
    inv = np.where(absmax > 1e-30, levels / np.maximum(absmax, 1e-30), 0.0)
    v = np.clip(np.rint(x * inv), -levels, levels)
    return v, absmax / levels


def quantize_groups(x, levels, group):
    """Per-`group`-values quantization with fp16 scales: the dequantized values."""
    shape = x.shape
    g = x.reshape(*shape[:-1], shape[-1] // group, group)
    absmax = np.abs(g).max(axis=-1, keepdims=True).astype(np.float16).astype(np.float32)
    inv = np.where(absmax > 1e-30, levels / np.maximum(absmax, 1e-30), 0.0)
    v = np.clip(np.rint(g * inv), -levels, levels)
    return (v * (absmax / levels)).reshape(shape)


def compact_keys(k, width):
    """Dequantized compact K of width `width` ([tokens][head_dim] -> same shape)."""
    if width == "int8-row":
        v, s = quantize_rows(k, 127.0)
        return v * s
    if width == "int4-row":
        v, s = quantize_rows(k, 7.0)
        return v * s
    if width == "int4-g16":
        return quantize_groups(k, 7.0, 16)
    raise ValueError(width)


def row_bytes(width, head_dim):
    return {"int8-row": head_dim + 4, "int4-row": head_dim // 2 + 4,
            "int4-g16": head_dim // 2 + 2 * (head_dim // 16)}[width]


def top(scores, k):
    return set(np.argpartition(-scores, k - 1)[:k].tolist()) if k < len(scores) else set(
        range(len(scores)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capture", required=True)
    ap.add_argument("--budget", default="0.02,0.05")
    ap.add_argument("--widths", default="int8-row,int4-row,int4-g16")
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--local", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args()
    budgets = [float(b) for b in args.budget.split(",")]
    widths = args.widths.split(",")
    index = json.load(open(os.path.join(args.capture, "index.json")))
    acc = {(w, b): {"overlap": [], "mass": []} for w in widths for b in budgets}
    for sample in sorted(d for d in os.listdir(args.capture)
                         if os.path.isdir(os.path.join(args.capture, d))):
        sdir = os.path.join(args.capture, sample)
        positions = np.load(os.path.join(sdir, "full_positions.npy"))
        layer = 0
        while os.path.exists(os.path.join(sdir, f"k_l{layer}.npy")):
            keys = bf16(np.load(os.path.join(sdir, f"k_l{layer}.npy")))  # [T][hkv][d]
            q = np.load(os.path.join(sdir, f"full_q_l{layer}.npy"))        # [R][hq][d]
            hkv, d = keys.shape[1], keys.shape[2]
            captured_head_dim = d
            group = q.shape[1] // hkv
            compact = {w: np.stack([compact_keys(keys[:, h], w) for h in range(hkv)], 1)
                       for w in widths}
            qv, qs = quantize_rows(q, 127.0)
            qd = qv * qs
            for r, pos in enumerate(positions):
                n = int(pos)  # keys before the query's own token; its own row is local
                lo, hi = args.sink, n - args.local
                if hi - lo < 16:
                    continue
                for h in range(hkv):
                    qg = q[r, h * group:(h + 1) * group]          # [group][d]
                    logits = keys[:n + 1, h] @ qg.T / np.sqrt(d)  # [n+1][group]
                    p = np.exp(logits - logits.max(axis=0))
                    p = (p / p.sum(axis=0)).mean(axis=1)
                    exact = (keys[lo:hi, h] @ qg.T).max(axis=1)
                    for b in budgets:
                        k = max(1, int(round(b * (hi - lo))))
                        ex = top(exact, k)
                        ex_mass = p[lo:hi][list(ex)].sum()
                        for w in widths:
                            sc = (compact[w][lo:hi, h] @ qd[r, h * group:(h + 1) * group].T).max(
                                axis=1)
                            pk = top(sc, k)
                            acc[(w, b)]["overlap"].append(len(pk & ex) / k)
                            acc[(w, b)]["mass"].append(
                                p[lo:hi][list(pk)].sum() / ex_mass if ex_mass > 0 else 1.0)
            layer += 1
    rows = []
    print(f"head_dim {captured_head_dim}; B/row at head_dim 128")
    print(f"{'width':10} {'B/row':>6} {'budget':>6} {'selections':>10} {'overlap':>8} "
          f"{'p10':>6} {'mass':>7} {'p10':>6}")
    for (w, b), a in acc.items():
        ov, ms = np.array(a["overlap"]), np.array(a["mass"])
        row = {"width": w, "bytes_per_row_head_dim_128": row_bytes(w, 128),
               "bytes_per_row_captured": row_bytes(w, captured_head_dim), "budget": b,
               "selections": int(len(ov)), "overlap_mean": float(ov.mean()),
               "overlap_p10": float(np.percentile(ov, 10)), "mass_mean": float(ms.mean()),
               "mass_p10": float(np.percentile(ms, 10))}
        rows.append(row)
        print(f"{w:10} {row['bytes_per_row_head_dim_128']:6d} {b:6.2f} {len(ov):10d} "
              f"{row['overlap_mean']:8.3f} {row['overlap_p10']:6.3f} {row['mass_mean']:7.3f} "
              f"{row['mass_p10']:6.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "tools/eval/compact_bits.py --capture DIR --budget "
                       + args.budget, "model": index.get("model"), "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
