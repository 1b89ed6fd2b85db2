#!/usr/bin/python3
"""Fits Fluxion's head-property predictor (ALGORITHMS.md §2.4.3) from head tables.

Input: CSV files written by `fluxion eval attention --capture DIR --head-table FILE.csv` over
calibration captures (`fluxion eval tasks --calibration --capture-dir DIR`). One row per (sample,
decode step, layer, KV head): the head's prefill features and its labels e_h(b), b in
{0, 0.02, 0.05} (error after the head's W_O slice, sink-free, exact top-k of the middle region).

Rows are aggregated per (sample, layer, KV head): the features are the prefill's (the same at
every step) and each label is the mean e_h(b) over the sample's decode steps. Two L2-regularised
logistic regressions on standardised features:
  streaming: e_h(0) <= tau (sinks + local window suffice);
  tier:      for retrieval heads, 1 when the 0.05 tier is needed (e_h(0.02) > tau), 0 when 0.02
             suffices; fitted only on heads whose context leaves the 0.02 tier any middle rows
             (below ~3.5K tokens it reads sinks + window only, and the label says nothing).
Validation: k-fold over samples (every head of a sample in the same fold, so no prompt is in both
the training and the validation part), regularisation strength chosen by the same folds.

Writes the JSON the decode side loads (decode/sparse/fluxion_predictor.h). python3 + numpy only.
"""
import argparse
import csv
import json
import math
import sys

import numpy as np

FEATURES = ["middle_share", "need_fraction", "sink_mass", "local_mass", "entropy", "layer_frac"]
TIERS = [0.02, 0.05]
LAMBDAS = [1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0]


def load(paths):
    groups = {}
    for path in paths:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                key = (path, row["sample"], int(row["layer"]), int(row["kv_head"]))
                g = groups.get(key)
                if g is None:
                    g = groups[key] = {
                        "sample": (path, row["sample"]),
                        "task": row["task"],
                        "context": int(row["context"]),
                        "seed": int(row["seed"]),
                        "x": [float(row[n]) for n in FEATURES],
                        "e": [],
                        "mid002": int(row["middle_rows_002"]),
                    }
                g["e"].append([float(row["e_0"]), float(row["e_002"]), float(row["e_005"])])
                g["mid002"] = min(g["mid002"], int(row["middle_rows_002"]))
    heads = list(groups.values())
    for h in heads:
        h["e"] = np.mean(np.array(h["e"]), axis=0)
    return heads


def fit_logistic(x, y, lam, iters=50):
    """Newton's method on the L2-regularised log-loss (bias not penalised). x is standardised."""
    n, d = x.shape
    xb = np.hstack([x, np.ones((n, 1))])
    w = np.zeros(d + 1)
    reg = np.full(d + 1, lam)
    reg[-1] = 0.0
    for _ in range(iters):
        z = np.clip(xb @ w, -30, 30)
        p = 1.0 / (1.0 + np.exp(-z))
        grad = xb.T @ (p - y) / n + reg * w
        hess = (xb.T * (p * (1 - p))) @ xb / n + np.diag(reg + 1e-9)
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.max(np.abs(step)) < 1e-10:
            break
    return w[:-1], w[-1]


def predict(x, w, b):
    return 1.0 / (1.0 + np.exp(-np.clip(x @ w + b, -30, 30)))


def folds_of(samples, k, seed=0):
    uniq = sorted(set(samples))
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(uniq))
    fold = {uniq[i]: j % k for j, i in enumerate(order)}
    return np.array([fold[s] for s in samples])


def metrics(y, p, threshold=0.5):
    pred = p > threshold
    tp = int(np.sum(pred & (y == 1)))
    tn = int(np.sum(~pred & (y == 0)))
    fp = int(np.sum(pred & (y == 0)))
    fn = int(np.sum(~pred & (y == 1)))
    pos = max(tp + fn, 1)
    neg = max(tn + fp, 1)
    return {
        "n": int(len(y)),
        "accuracy": (tp + tn) / max(len(y), 1),
        "balanced_accuracy": 0.5 * (tp / pos + tn / neg),
        "majority_baseline": max(np.mean(y), 1 - np.mean(y)) if len(y) else 0.0,
        "positives": int(np.sum(y == 1)),
        "true_pos": tp, "true_neg": tn, "false_pos": fp, "false_neg": fn,
    }


def cross_validate(x, y, fold, k):
    """Out-of-fold probabilities for each lambda; returns the best lambda and its predictions."""
    best = None
    for lam in LAMBDAS:
        p = np.zeros(len(y))
        for f in range(k):
            tr, va = fold != f, fold == f
            if va.sum() == 0:
                continue
            if len(set(y[tr])) < 2:
                p[va] = np.mean(y[tr])
                continue
            mean, scale = x[tr].mean(0), x[tr].std(0) + 1e-6
            w, b = fit_logistic((x[tr] - mean) / scale, y[tr], lam)
            p[va] = predict((x[va] - mean) / scale, w, b)
        eps = 1e-9
        loss = -np.mean(y * np.log(p + eps) + (1 - y) * np.log(1 - p + eps))
        if best is None or loss < best[0]:
            best = (loss, lam, p)
    return best[1], best[2], best[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("tables", nargs="+", help="head-table CSV files")
    ap.add_argument("--out", required=True, help="predictor JSON to write")
    ap.add_argument("--tau", type=float, default=0.02, help="per-head error tolerance")
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--threshold", type=float, default=0.5,
                    help="P(streaming) above which a head is called streaming (validation also "
                         "reports e_h(0) of the retrieval heads called streaming: what a false "
                         "positive costs)")
    ap.add_argument("--rules-epsilon", type=float, default=0.85,
                    help="the fallback's streaming rule (middle_share < 1 - epsilon), for comparison")
    args = ap.parse_args()

    heads = load(args.tables)
    if not heads:
        sys.exit("no rows in " + ", ".join(args.tables))
    x = np.array([h["x"] for h in heads])
    if not np.all(np.isfinite(x)):
        bad = int(np.sum(~np.isfinite(x).all(1)))
        print(f"dropping {bad} heads with non-finite features", file=sys.stderr)
    keep = np.isfinite(x).all(1)
    heads = [h for h, k in zip(heads, keep) if k]
    x = x[keep]
    e = np.array([h["e"] for h in heads])
    samples = [h["sample"] for h in heads]
    fold = folds_of(samples, args.folds)

    y_stream = (e[:, 0] <= args.tau).astype(float)
    lam_s, p_s, loss_s = cross_validate(x, y_stream, fold, args.folds)
    rules = (x[:, 0] < 1 - args.rules_epsilon).astype(float)

    retrieval = y_stream == 0
    tier_rows = retrieval & (np.array([h["mid002"] for h in heads]) > 0)
    y_tier = (e[:, 1] > args.tau).astype(float)
    if tier_rows.sum() >= 2 * args.folds and len(set(y_tier[tier_rows])) == 2:
        lam_t, p_t, loss_t = cross_validate(x[tier_rows], y_tier[tier_rows], fold[tier_rows],
                                            args.folds)
        tier_val = metrics(y_tier[tier_rows], p_t)
    else:
        lam_t, tier_val = 1.0, {"n": int(tier_rows.sum()), "note": "too few or one-class rows"}

    mean, scale = x.mean(0), x.std(0) + 1e-6
    z = (x - mean) / scale
    w_s, b_s = fit_logistic(z, y_stream, lam_s)
    if tier_rows.sum() > 0 and len(set(y_tier[tier_rows])) == 2:
        w_t, b_t = fit_logistic(z[tier_rows], y_tier[tier_rows], lam_t)
    else:
        # One class only: a constant classifier at the observed majority (0.05 when unknown).
        frac = float(np.mean(y_tier[tier_rows])) if tier_rows.sum() else 1.0
        w_t, b_t = np.zeros(len(FEATURES)), 5.0 if frac >= 0.5 else -5.0

    contexts = sorted(set(h["context"] for h in heads))
    tasks = sorted(set(h["task"] for h in heads))
    seeds = sorted(set(h["seed"] for h in heads))
    stream_val = metrics(y_stream, p_s, args.threshold)
    stream_val["threshold"] = args.threshold
    fp = (p_s > args.threshold) & (y_stream == 0)
    stream_val["false_pos_e0_mean"] = float(e[fp, 0].mean()) if fp.any() else 0.0
    stream_val["false_pos_e0_max"] = float(e[fp, 0].max()) if fp.any() else 0.0
    stream_val["retrieval_e0_median"] = float(np.median(e[y_stream == 0, 0]))
    stream_val["lambda"] = lam_s
    stream_val["log_loss"] = loss_s
    stream_val["rules_fallback"] = metrics(y_stream, rules)
    if "accuracy" in tier_val:
        tier_val["lambda"] = lam_t
        tier_val["log_loss"] = loss_t
    per_context = {}
    for c in contexts:
        m = np.array([h["context"] == c for h in heads])
        per_context[str(c)] = {
            "heads": int(m.sum()),
            "streaming_share": float(np.mean(y_stream[m])),
            "streaming_accuracy": metrics(y_stream[m], p_s[m], args.threshold)["accuracy"],
            "rules_accuracy": metrics(y_stream[m], rules[m])["accuracy"],
            "mean_e": [float(v) for v in e[m].mean(0)],
        }
    doc = {
        "format": "fluxion-head-predictor",
        "version": 1,
        "features": FEATURES,
        "mean": [float(v) for v in mean],
        "scale": [float(v) for v in scale],
        "tau": args.tau,
        "streaming": {"weights": [float(v) for v in w_s], "bias": float(b_s), "threshold": args.threshold,
                      "label": "mean over decode steps of e_h(0) <= tau"},
        "tier": {"weights": [float(v) for v in w_t], "bias": float(b_t), "tiers": TIERS,
                 "label": "retrieval heads: 1 (tier 0.05) when mean e_h(0.02) > tau"},
        "calibration": {
            "seeds": [seeds[0], seeds[-1]] if seeds else [],
            "samples": len(set(samples)),
            "tasks": tasks,
            "contexts": contexts,
            "heads": len(heads),
            "tier_heads": int(tier_rows.sum()),
        },
        "validation": {
            "method": f"{args.folds}-fold cross-validation over samples (held-out seeds)",
            "streaming": stream_val,
            "tier": tier_val,
            "per_context": per_context,
        },
        "command": " ".join(["tools/fluxion_predictor/train.py"] + sys.argv[1:]),
    }
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    print(json.dumps(doc["validation"], indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
