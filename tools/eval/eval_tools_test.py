#!/usr/bin/env python3
"""Tests of paired_table.py (pooling, FILE:POLICY filter, overlap refusal), pair_policies.py,
merge_runs.py, frontier.py (its table; the plot needs matplotlib, which CI does not install) and
compact_bits.py (on a synthetic capture)."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "paired_table.py")
PAIR = os.path.join(HERE, "pair_policies.py")
MERGE = os.path.join(HERE, "merge_runs.py")
FRONTIER = os.path.join(HERE, "frontier.py")
COMPACT_BITS = os.path.join(HERE, "compact_bits.py")


def numpy_python():
    """An interpreter with numpy: this one, else Debian's (tools/setup.sh installs python3-numpy
    there; a python3 earlier on PATH, e.g. pyenv's, may lack it)."""
    for exe in (sys.executable, "/usr/bin/python3"):
        if subprocess.run([exe, "-c", "import numpy"], capture_output=True).returncode == 0:
            return exe
    raise AssertionError("no python3 with numpy: run tools/setup.sh (python3-numpy)")


def row(policy, seed, correct, samples, lost=0, gained=0, read=1.0, task="niah_single"):
    return {"context": 4096, "task": task, "policy": policy, "seed": seed, "correct": correct,
            "samples": samples, "paired_lost": lost, "paired_gained": gained,
            "budget_spent": read}


class PairedTableTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()

    def tearDown(self):
        self.dir.cleanup()

    def write(self, name, rows):
        path = os.path.join(self.dir.name, name)
        with open(path, "w") as f:
            json.dump({"results": rows}, f)
        return path

    def run_table(self, *args):
        return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)

    def test_pools_disjoint_seed_ranges_and_filters_policies(self):
        a = self.write("a.json", [row("full", 100, 10, 10), row("lfps@0.02", 100, 7, 10, lost=3),
                                  row("exact_topk@0.02", 100, 9, 10, lost=1, read=0.02)])
        b = self.write("b.json", [row("full", 200, 9, 10), row("lfps@0.02", 200, 9, 10, lost=1,
                                                               gained=1)])
        out = self.run_table(a + ":full,exact_topk@0.02", b)
        self.assertEqual(out.returncode, 0, out.stderr)
        lines = {l.split("|")[1].strip(): l for l in out.stdout.splitlines() if l.startswith("| ")}
        self.assertIn("19/20", lines["full"])
        # a.json's lfps rows were left out: only b.json's 10 samples count.
        self.assertIn("9/10 (-1/+1)", lines["lfps@0.02"])
        self.assertIn("9/10 (-1/+0)", lines["exact_topk@0.02"])

    def test_overlapping_seed_ranges_are_refused(self):
        a = self.write("a.json", [row("full", 100, 10, 10)])
        b = self.write("b.json", [row("full", 105, 10, 10)])
        out = self.run_table(a, b)
        self.assertNotEqual(out.returncode, 0)
        self.assertIn("overlap", out.stderr)


    def test_pair_policies_pairs_across_logs_and_refuses_duplicates(self):
        new = os.path.join(self.dir.name, "new.txt")
        old = os.path.join(self.dir.name, "old.txt")
        with open(new, "w") as f:
            f.write("[1/3] aggregate 4096 seed 7: full=ok fluxion@0.02=ok (prefill 1 ms)\n"
                    "[2/3] aggregate 4096 seed 8: full=ok fluxion@0.02=wrong (prefill 1 ms)\n"
                    "[3/3] aggregate 4096 seed 9: full=ok fluxion@0.02=ok (prefill 1 ms)\n")
        with open(old, "w") as f:
            f.write("[1/3] aggregate 4096 seed 7: full=ok exact_topk@0.02=wrong (prefill 1 ms)\n"
                    "[2/3] aggregate 4096 seed 8: full=ok exact_topk@0.02=ok (prefill 1 ms)\n"
                    "[3/3] aggregate 4096 seed 9: full=ok exact_topk@0.02=wrong (prefill 1 ms)\n")
        out = subprocess.run([sys.executable, PAIR, "fluxion@0.02", "exact_topk@0.02", new,
                              old + ":exact_topk@0.02"], capture_output=True, text=True)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("3 prompts, only fluxion@0.02 right 2, only exact_topk@0.02 right 1", out.stdout)
        self.assertIn("+33.3 points", out.stdout)
        dup = subprocess.run([sys.executable, PAIR, "full", "fluxion@0.02", new, old],
                             capture_output=True, text=True)
        self.assertNotEqual(dup.returncode, 0)
        self.assertIn("also in an earlier log", dup.stderr)

    def test_merge_runs_joins_consecutive_seeds_keeps_gaps_and_sorts_the_log(self):
        runs = []
        for seed, correct, lost in ((7, 1, 0), (8, 0, 1), (10, 1, 0)):
            path = self.write(f"run{seed}.json", [
                row("full", seed, 1, 1, read=1.0), row("lfps@0.02", seed, correct, 1, lost=lost,
                                                       read=0.02 if seed == 7 else 0.03)])
            with open(path[:-len(".json")] + ".txt", "w") as f:
                f.write("fluxion policy: rules\n"
                        f"[1/1] niah_single 4096 seed {seed}: full=ok lfps@0.02=ok (prefill 1 ms)\n"
                        "task  context  policy\n")
            runs.append(path)
        out_json = os.path.join(self.dir.name, "merged.json")
        out_log = os.path.join(self.dir.name, "merged.txt")
        out = subprocess.run([sys.executable, MERGE, out_json, *reversed(runs), "--log", out_log],
                             capture_output=True, text=True)
        self.assertEqual(out.returncode, 0, out.stderr)
        with open(out_json) as f:
            doc = json.load(f)
        self.assertEqual(doc["merged_runs"], 3)
        lfps = [r for r in doc["results"] if r["policy"] == "lfps@0.02"]
        # Seeds 7 and 8 follow each other and merge; 10 stays apart (9 is missing).
        self.assertEqual([(r["seed"], r["samples"], r["correct"], r["paired_lost"]) for r in lfps],
                         [(7, 2, 1, 1), (10, 1, 1, 0)])
        self.assertAlmostEqual(lfps[0]["budget_spent"], 0.025)
        self.assertAlmostEqual(lfps[0]["accuracy"], 0.5)
        self.assertAlmostEqual(lfps[0]["delta_vs_first"], -0.5)
        with open(out_log) as f:
            self.assertEqual([l.split(" seed ")[1][:2] for l in f.read().splitlines()],
                             ["7:", "8:", "10"])
        # The same seed twice is refused.
        dup = subprocess.run([sys.executable, MERGE, out_json, runs[0], runs[0]],
                             capture_output=True, text=True)
        self.assertNotEqual(dup.returncode, 0)
        self.assertIn("overlap", dup.stderr)

    def test_merge_runs_adds_the_guards_counts_and_averages_its_read(self):
        paths = []
        for seed, checks, escalations, guard_read in ((7, 40, 1, 0.04), (8, 60, 0, 0.05)):
            r = row("fluxion@0.02+guard", seed, 1, 1, read=0.02)
            r.update(guard_checks=checks, guard_escalations=escalations, guard_read=guard_read,
                     guard_error_p50=0.1, guard_error_p90=0.3)
            paths.append(self.write(f"g{seed}.json", [r]))
        out_json = os.path.join(self.dir.name, "merged.json")
        out = subprocess.run([sys.executable, MERGE, out_json, *paths], capture_output=True,
                             text=True)
        self.assertEqual(out.returncode, 0, out.stderr)
        with open(out_json) as f:
            (merged,) = json.load(f)["results"]
        self.assertEqual((merged["samples"], merged["guard_checks"], merged["guard_escalations"]),
                         (2, 100, 1))
        self.assertAlmostEqual(merged["guard_read"], 0.045)
        self.assertNotIn("guard_error_p50", merged)  # one run's quantile is not the pool's

    def test_merge_runs_concatenates_per_sample_records_of_one_device(self):
        paths = []
        for seed, device in ((7, "cuda"), (8, "cuda"), (9, "cpu")):
            path = os.path.join(self.dir.name, f"dev{seed}.json")
            with open(path, "w") as f:
                json.dump({"device": device, "results": [row("full", seed, 1, 1)],
                           "samples": [{"task": "niah_single", "seed": seed}]}, f)
            paths.append(path)
        out_json = os.path.join(self.dir.name, "merged.json")
        out = subprocess.run([sys.executable, MERGE, out_json, *paths[:2]], capture_output=True,
                             text=True)
        self.assertEqual(out.returncode, 0, out.stderr)
        with open(out_json) as f:
            doc = json.load(f)
        self.assertEqual(doc["device"], "cuda")
        self.assertEqual([s["seed"] for s in doc["samples"]], [7, 8])
        mixed = subprocess.run([sys.executable, MERGE, out_json, *paths], capture_output=True,
                               text=True)
        self.assertNotEqual(mixed.returncode, 0)
        self.assertIn("device cpu", mixed.stderr)


class FrontierTest(unittest.TestCase):
    def test_joins_each_decode_row_to_its_paired_accuracy(self):
        with tempfile.TemporaryDirectory() as d:
            speed = os.path.join(d, "decode.json")
            with open(speed, "w") as f:
                json.dump({"results": [
                    {"policy": "hbm-full", "batch": 1, "context": 131072, "step_ms": 12.5},
                    {"policy": "fluxion@0.05+device/tiny-retrieval-16k/zc0.5", "batch": 1,
                     "context": 131072, "step_ms": 30.0, "host_rows_per_step": 500,
                     "device_read_rows_per_step": 300},
                    {"policy": "fluxion@0.05+device/tiny-retrieval-16k/zc0.5", "batch": 4,
                     "context": 131072, "step_ms": 99.0},
                    {"policy": "quest@0.05/zc0.5", "batch": 1, "context": 131072,
                     "step_ms": 20.0}]}, f)
            big = os.path.join(d, "big.json")
            with open(big, "w") as f:
                json.dump({"results": [
                    row("full", 0, 90, 100, task="a"),
                    row("fluxion@0.05+device", 0, 88, 100, lost=3, gained=1, task="a"),
                    row("fluxion@0.05+device", 0, 50, 100, lost=0, gained=0, task="b")]}, f)
            small = os.path.join(d, "small.json")
            with open(small, "w") as f:
                json.dump({"results": [row("fluxion@0.05+device", 0, 9, 10, lost=5)]}, f)
            out = subprocess.run([sys.executable, FRONTIER, "--speed", speed, "--accuracy", big,
                                  small], capture_output=True, text=True)
            self.assertEqual(out.returncode, 0, out.stderr)
            lines = out.stdout.splitlines()
            # Sorted by step; the first accuracy file holding a policy gives it (200 prompts,
            # -2 of them net: -1.0 points); batch 4 is another point; quest has no accuracy.
            self.assertIn("| full (KV in HBM) | 12.50 |", lines[2])
            self.assertIn("| quest@0.05 | 20.00 |  | not measured |", lines[3])
            self.assertIn("| fluxion@0.05+device | 30.00 | 800 | -1.0 [", lines[4])
            self.assertIn("| 200 | decode.json, big.json |", lines[4])
            self.assertEqual(len(lines), 5)


# A capture of one layer, one KV head of 32 (a group of two query heads), two steps: six rows far
# above the rest for both steps' queries, which every width must pick.
PLANTED_CAPTURE = """
import json, os, sys
import numpy as np
cap = sys.argv[1]
rng = np.random.default_rng(0)
keys = rng.normal(0, 0.05, (600, 1, 32)).astype(np.float32)
query = rng.normal(0, 1, (2, 2, 32)).astype(np.float32)
for t in [50, 120, 300, 310, 400, 450]:
    keys[t, 0] = 4.0 * (query[0, 0] + query[1, 1]) / np.linalg.norm(query[0, 0])
with open(os.path.join(cap, "index.json"), "w") as f:
    json.dump({"model": "synthetic"}, f)
sample = os.path.join(cap, "s_600_0")
os.mkdir(sample)
np.save(os.path.join(sample, "k_l0.npy"), keys)
np.save(os.path.join(sample, "full_q_l0.npy"), query)
np.save(os.path.join(sample, "full_positions.npy"), np.array([598, 599]))
"""


class CompactBitsTest(unittest.TestCase):
    def test_ranks_planted_rows_and_reports_each_width(self):
        python = numpy_python()
        with tempfile.TemporaryDirectory() as cap:
            # The capture is written by the numpy interpreter too (this one may lack numpy).
            make = subprocess.run([python, "-c", PLANTED_CAPTURE, cap], capture_output=True,
                                  text=True)
            self.assertEqual(make.returncode, 0, make.stderr)
            out_json = os.path.join(cap, "out.json")
            # 6 / (598 - 64 - 4 middle rows) ~ 0.0113: k is the planted rows.
            out = subprocess.run([python, COMPACT_BITS, "--capture", cap, "--budget",
                                  "0.0113", "--json", out_json], capture_output=True, text=True)
            self.assertEqual(out.returncode, 0, out.stderr)
            rows = {r["width"]: r for r in json.load(open(out_json))["results"]}
        self.assertEqual(set(rows), {"int8-row", "int4-row", "int4-g16"})
        for r in rows.values():
            self.assertEqual(r["selections"], 2)
            self.assertEqual(r["overlap_mean"], 1.0)
            self.assertAlmostEqual(r["mass_mean"], 1.0, places=6)
        self.assertEqual(rows["int8-row"]["bytes_per_row_head_dim_128"], 132)
        self.assertEqual(rows["int4-row"]["bytes_per_row_captured"], 20)


if __name__ == "__main__":
    unittest.main()
