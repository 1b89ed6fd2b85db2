"""Greedy answers of an exported model on docs/TASKS.md samples, CPU or GPU, without transformers.

    python3 tools/train/sample.py models/fluxion-tiny-retrieval --task niah_single --length 1024 \\
        --seeds 1000000-1000004

Reads config.json + model.safetensors (bf16 or fp32) directly, runs the same decoder as the
training script's evaluation (fp32 compute on CPU), prints prompt tail, expected and generated
answer, and the exact-match score. Useful as reference output for the C++ evaluator.
"""
import argparse
import json
import os
import struct
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tasks  # noqa: E402
from model import CONFIG, Llama, greedy_generate  # noqa: E402

DT = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}


def load_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        t = torch.frombuffer(bytearray(data[a:b]), dtype=DT[v["dtype"]]).reshape(v["shape"])
        out[k] = t.float()
    return out


def load_model(folder):
    cfg = json.load(open(os.path.join(folder, "config.json")))
    c = dict(CONFIG)
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps"):
        c[k] = cfg[k]
    rp = cfg.get("rope_parameters") or {}
    c["rope_theta"] = rp.get("rope_theta", cfg.get("rope_theta"))
    m = Llama(c)
    sd = load_safetensors(os.path.join(folder, "model.safetensors"))
    missing, unexpected = m.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return m.eval()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--task", default="niah_single", choices=tasks.TASKS)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--seeds", default="1000000-1000004")
    a = p.parse_args()
    lo, hi = (int(x) for x in a.seeds.split("-"))
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    m = load_model(a.model).to(dev)
    ss = [tasks.make_eval_sample(a.task, a.length, s) for s in range(lo, hi + 1)]
    gens = greedy_generate(m, [[tasks.BOS] + list(s["prompt"].encode()) for s in ss],
                           max(len(s["answer"]) for s in ss) + 16, dev)
    ok = 0
    for s, g in zip(ss, gens):
        good = tasks.score(s["answer"], g)
        ok += good
        print("seed %d (%d tokens) ...%r" % (s["seed"], s["n_tokens"], s["prompt"][-60:]))
        print("  want %r\n  got  %r  %s" % (s["answer"], tasks.continuation_text(
            g[:len(s["answer"]) + 16]), "OK" if good else "WRONG"))
    print("%s@%d: %d/%d" % (a.task, a.length, ok, len(ss)))


if __name__ == "__main__":
    main()
