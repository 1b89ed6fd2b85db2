"""Train fluxion-tiny-retrieval on the docs/TASKS.md training mixture (see README.md here).

One invocation trains from step 0 or from a checkpoint until a step limit or a wall-clock budget,
then saves a checkpoint (split into parts of <= 15 MiB), optionally evaluates and exports.
Deterministic given the step index: the batch of step s is generated from random.Random(s)
(training seeds are the step indices, < 1,000,000).
"""
import argparse
import io
import json
import math
import os
import random
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tasks  # noqa: E402
from model import CONFIG, Llama, greedy_generate, n_params  # noqa: E402

T0 = time.time()
TOKENS_PER_STEP = 131072


def log(*a):
    msg = "[%7.1fs] " % (time.time() - T0) + " ".join(str(x) for x in a)
    print(msg, flush=True)
    if LOGF is not None:
        LOGF.write(msg + "\n")
        LOGF.flush()


LOGF = None

# ---------------------------------------------------------------------------------------------
# Curriculum: (first step, [(row length, probability), ...]). Row length includes BOS; the longest
# bucket is 16K + 1K so that 16K prompts plus a 256-token answer stay inside trained positions.
# ---------------------------------------------------------------------------------------------
CURRICULUM = [
    (0, "A", [(256, 1.0)]),
    (300, "B", [(1024, 1.0)]),
    (900, "C", [(4096, 0.8), (1024, 0.2)]),
    (1500, "D", [(17408, 0.55), (4096, 0.3), (1024, 0.15)]),
    (4291, "E", [(17408, 0.35), (4096, 0.3), (1024, 0.35)]),  # run 2: more short, dense steps
    # run 3 on (from the exported run-2 weights): the hard tasks twice per sequence (tasks.py
    # make_train_sequence focus=True), more short rows, 16K kept so long contexts do not degrade.
    (8249, "F", [(17408, 0.25), (4096, 0.35), (1024, 0.4)]),
]
FOCUS_PHASES = {"F"}


def phase_of(step, cur=CURRICULUM):
    ph = cur[0]
    for p in cur:
        if step >= p[0]:
            ph = p
    return ph


def step_shape(step, cur=CURRICULUM, tokens=TOKENS_PER_STEP):
    """(row length, rows) of step ``step``: drawn from the phase's mixture with Random(step)."""
    _, _, mix = phase_of(step, cur)
    r = random.Random(step).random()
    acc = 0.0
    L = mix[-1][0]
    for length, p in mix:
        acc += p
        if r < acc:
            L = length
            break
    return L, max(1, tokens // L)


def make_batch(step, cur=CURRICULUM, tokens=TOKENS_PER_STEP):
    L, rows = step_shape(step, cur, tokens)
    focus = phase_of(step, cur)[1] in FOCUS_PHASES
    rng = random.Random(step)  # training seed = step (< 1,000,000)
    rng.random()  # the draw step_shape used
    tb = bytearray()
    cb = bytearray()
    for _ in range(rows):
        text, spans = tasks.make_train_sequence(rng, L + 1, focus=focus)
        t, c = tasks.encode_train(text, spans, L + 1)
        tb += t
        cb += c
    toks = torch.frombuffer(tb, dtype=torch.uint8).view(rows, L + 1).to(torch.int16)
    cls = torch.frombuffer(cb, dtype=torch.uint8).view(rows, L + 1).clone()
    toks[:, 0] = tasks.BOS
    toks[(cls == 0) & (torch.arange(L + 1)[None] > 0)] = tasks.PAD
    return step, toks, cls


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, start, stop, cur, tokens):
        self.start, self.stop, self.cur, self.tokens = start, stop, cur, tokens

    def __iter__(self):
        wi = torch.utils.data.get_worker_info()
        wid, nw = (0, 1) if wi is None else (wi.id, wi.num_workers)
        for s in range(self.start + wid, self.stop, nw):
            yield make_batch(s, self.cur, self.tokens)


# ---------------------------------------------------------------------------------------------
# Checkpoints: one torch.save blob split into parts (the device tool returns files <= 16 MiB)
# ---------------------------------------------------------------------------------------------
PART = 15 * 1024 * 1024


def save_ckpt(path, model, opt, step, extra):
    os.makedirs(path, exist_ok=True)
    osd = opt.state_dict()
    for st in osd["state"].values():
        for k in ("exp_avg", "exp_avg_sq"):
            st[k] = st[k].to(torch.bfloat16).cpu()
        if torch.is_tensor(st.get("step")):
            st["step"] = st["step"].cpu()
    blob = {"model": {k: v.detach().float().cpu() for k, v in model.state_dict().items()},
            "opt": osd, "step": step, "extra": extra, "config": model.c}
    buf = io.BytesIO()
    torch.save(blob, buf)
    data = buf.getvalue()
    for f in os.listdir(path):
        if f.startswith("part-"):
            os.remove(os.path.join(path, f))
    n = 0
    for i in range(0, len(data), PART):
        with open(os.path.join(path, "part-%02d" % n), "wb") as fh:
            fh.write(data[i:i + PART])
        n += 1
    log("checkpoint step %d: %d bytes in %d parts -> %s" % (step, len(data), n, path))


def load_ckpt(path):
    parts = sorted(f for f in os.listdir(path) if f.startswith("part-"))
    data = b"".join(open(os.path.join(path, f), "rb").read() for f in parts)
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


# ---------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------
def _gen_sample(a):
    return tasks.make_eval_sample(*a)


def evaluate(model, device, lengths, n, task_list=tasks.TASKS, pool=None, seed0=1000000,
             n_by_len=None, deadline=None, est_s_per_len=30.0, dump=None):
    """Greedy full-attention accuracy per (task, length). All tasks of one length decode as one
    batch (decode cost here is per step, not per sample). Results are written to ``dump`` after
    each length; a length is skipped if ``deadline`` (time.time() value) is too close."""
    model.eval()
    res = {}
    ac = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else \
        torch.autocast("cpu", enabled=False)
    for L in lengths:
        if deadline is not None and time.time() + est_s_per_len > deadline:
            log("eval: skipping L=%d (deadline)" % L)
            continue
        t0 = time.time()
        nn_ = (n_by_len or {}).get(L, n)
        jobs = [(t, L, seed0 + i) for t in task_list for i in range(nn_)]
        ss = pool.map(_gen_sample, jobs, chunksize=4) if pool else [_gen_sample(j) for j in jobs]
        prompts = [[tasks.BOS] + list(s["prompt"].encode("ascii")) for s in ss]
        max_new = max(len(s["answer"]) for s in ss) + 16
        with ac:
            gens = greedy_generate(model, prompts, max_new, device)
        by = {}
        for s, g in zip(ss, gens):
            by.setdefault(s["task"], []).append((s, g))
        for t in task_list:
            ok = 0
            wrong = None
            for s, g in by[t]:
                good = tasks.score(s["answer"], g)
                ok += good
                if not good and wrong is None:
                    wrong = (s["answer"], tasks.continuation_text(g[:len(s["answer"]) + 16]))
            m = len(by[t])
            lo, hi = tasks.wilson(ok, m)
            res["%s@%d" % (t, L)] = {"task": t, "length": L, "n": m, "correct": ok, "acc": ok / m,
                                     "wilson95": [lo, hi], "seeds": [seed0, seed0 + m - 1],
                                     "mean_prompt_tokens": sum(s["n_tokens"] for s, _ in by[t]) / m}
            log("eval %-16s L=%-6d acc %.3f (%d/%d) [%.3f, %.3f]" % (t, L, ok / m, ok, m, lo, hi))
            if wrong:
                log("  wrong example: want %r got %r" % (wrong[0][:70], wrong[1][:70]))
        log("eval L=%d: %d samples in %.1fs" % (L, len(ss), time.time() - t0))
        est_s_per_len = max(est_s_per_len, (time.time() - t0) * 1.3)
        if dump:
            with open(dump, "w") as fh:
                json.dump(res, fh, indent=1)
    model.train()
    return res


# ---------------------------------------------------------------------------------------------
def lr_at(step, a):
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    if a.decay_start is not None and step >= a.decay_start:
        f = min(1.0, (step - a.decay_start) / max(1, a.max_steps - a.decay_start))
        return a.lr * (1.0 - 0.9 * f)
    return a.lr


def main():
    global LOGF
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="output folder (checkpoint, log, eval, export)")
    p.add_argument("--resume", default=None, help="checkpoint folder with part-NN files")
    p.add_argument("--init-from", default=None,
                   help="start from an exported model folder (config.json + model.safetensors) "
                        "with a fresh optimizer; use with --start-step to keep the data stream")
    p.add_argument("--start-step", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=100000)
    p.add_argument("--time-budget-s", type=float, default=480,
                   help="stop training when this many seconds have passed since start")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--decay-start", type=int, default=None,
                   help="linear decay to 0.1 x lr from this step to --max-steps")
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--quick-eval", type=int, default=0, help="samples per (task, length) after training")
    p.add_argument("--quick-lengths", default="1024,4096")
    p.add_argument("--final-eval", type=int, default=0, help="samples per (task, length), full table")
    p.add_argument("--final-lengths", default="1024,4096,16384,32768")
    p.add_argument("--n-32k", type=int, default=None, help="samples per task at 32K (default = final-eval)")
    p.add_argument("--export", default=None, help="folder for the HF export (save_pretrained, bf16)")
    p.add_argument("--deadline-s", type=float, default=1e9,
                   help="evaluation skips lengths that would end after this many seconds")
    p.add_argument("--check-hf", action="store_true", help="compare logits with transformers first")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny model, short lengths")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--label-weights", default="",
                   help="answer-loss weight per label, e.g. vt=3,aggregate=2 (default 1 each)")
    p.add_argument("--no-decay-embed-norm", action="store_true",
                   help="no weight decay on the (tied) embeddings and norm gains: run 2's decay "
                        "shrank the rare capital letters' rows (the passage-copy failure)")
    a = p.parse_args()

    os.makedirs(a.out, exist_ok=True)
    LOGF = open(os.path.join(a.out, "log.txt"), "a")
    log("args", vars(a))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    random.seed(0)
    cfg = dict(CONFIG)
    cur, tokens = CURRICULUM, TOKENS_PER_STEP
    if a.tiny:
        cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16)
        cur = [(0, "A", [(256, 1.0)]), (3, "B", [(512, 0.5), (256, 0.5)]), (6, "C", [(1024, 1.0)])]
        tokens = 2048
    if device.type == "cuda":
        log("device", torch.cuda.get_device_name(0), "torch", torch.__version__)
    model = Llama(cfg).to(device)
    log("params", n_params(model))
    if a.check_hf:
        from model import check_against_hf
        import transformers
        try:
            diff, theta = check_against_hf(model, device)
            log("HF check (transformers %s): max |logit diff| fp32 = %.2e, rope_theta %s -> %s" %
                (transformers.__version__, diff, theta, "OK" if diff < 1e-3 and
                 float(theta) == CONFIG["rope_theta"] else "MISMATCH"))
        except Exception as e:  # keep training: the export is fixed separately if needed
            import traceback
            log("HF check FAILED:", repr(e), traceback.format_exc())
    okw = {"fused": True} if device.type == "cuda" else {}
    if a.no_decay_embed_norm:
        decay = [p_ for n_, p_ in model.named_parameters() if p_.dim() >= 2 and "embed" not in n_]
        keep = [p_ for n_, p_ in model.named_parameters() if not (p_.dim() >= 2 and "embed" not in n_)]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": keep, "weight_decay": 0.0}]
    else:
        groups = model.parameters()
    opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            eps=1e-8, **okw)
    label_w = torch.ones(2 + len(tasks.TRAIN_LABELS))
    for kv in filter(None, a.label_weights.split(",")):
        name, w = kv.split("=")
        label_w[2 + tasks.TRAIN_LABELS.index(name)] = float(w)
    label_w = label_w.to(device)
    log("label weights", label_w.tolist(), "no-decay embed/norm", a.no_decay_embed_norm)
    step = a.start_step
    history = []
    if a.init_from:
        from sample import load_safetensors
        model.load_state_dict(load_safetensors(os.path.join(a.init_from, "model.safetensors")),
                              strict=False)
        log("initialised from %s, fresh optimizer, step %d" % (a.init_from, step))
    if a.resume:
        ck = load_ckpt(a.resume)
        model.load_state_dict(ck["model"])
        osd = ck["opt"]
        for st in osd["state"].values():
            for k in ("exp_avg", "exp_avg_sq"):
                st[k] = st[k].float()
        opt.load_state_dict(osd)
        step = ck["step"]
        history = ck["extra"].get("history", [])
        log("resumed from %s at step %d (phase %s)" % (a.resume, step, phase_of(step, cur)[1]))

    pool = None
    if a.quick_eval or a.final_eval:
        import multiprocessing as mp
        pool = mp.get_context("fork").Pool(max(1, min(12, (os.cpu_count() or 2) - 2)))

    stop = a.max_steps
    kw = {"prefetch_factor": 4} if a.workers else {}
    loader = torch.utils.data.DataLoader(Stream(step, stop, cur, tokens), batch_size=None,
                                         num_workers=a.workers, pin_memory=device.type == "cuda",
                                         **kw)
    model.train()
    ac = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else \
        torch.autocast("cpu", enabled=False)
    acc = {"n": 0}
    t_train = time.time()
    t_last = time.time()
    steps_this_run = 0
    phase_time = {}
    for s, toks, cls in loader:
        assert s == step, (s, step)
        if time.time() - T0 > a.time_budget_s:
            log("time budget reached at step %d" % step)
            break
        ts = time.time()
        for gp in opt.param_groups:
            gp["lr"] = lr_at(step, a)
        toks = toks.to(device, non_blocking=True).long()
        cls = cls.to(device, non_blocking=True).long()
        inp, tgt, c = toks[:, :-1], toks[:, 1:], cls[:, 1:]
        with ac:
            logits = model(inp)
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                             reduction="none").view_as(tgt)
        ans = c >= 2
        lm = c == 1
        wa = label_w[c] * ans
        ans_loss = (ce * wa).sum() / wa.sum().clamp(min=1)
        lm_loss = (ce * lm).sum() / lm.sum().clamp(min=1)
        loss = ans_loss + 0.1 * lm_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        # per-label answer loss (summed, averaged at log time)
        with torch.no_grad():
            stats = torch.stack([(ce * (c == 2 + i)).sum() for i in range(len(tasks.TRAIN_LABELS))]
                                + [(c == 2 + i).sum().float() for i in range(len(tasks.TRAIN_LABELS))]
                                + [ans_loss.detach(), lm_loss.detach(), gn.detach().float()])
        acc["n"] += 1
        acc["s"] = stats if "s" not in acc else acc["s"] + stats
        L = toks.shape[1] - 1
        step += 1
        steps_this_run += 1
        if device.type == "cuda" and steps_this_run <= 3:
            torch.cuda.synchronize()
        key = "%s/%d" % (phase_of(step - 1, cur)[1], L)
        phase_time[key] = phase_time.get(key, [0, 0.0])
        phase_time[key][0] += 1
        phase_time[key][1] += time.time() - ts
        if step % a.log_every == 0 or steps_this_run <= 2:
            st = (acc["s"] / 1).tolist()
            k = len(tasks.TRAIN_LABELS)
            per = {tasks.TRAIN_LABELS[i]: round(st[i] / st[k + i], 3) if st[k + i] > 0 else None
                   for i in range(k)}
            rec = {"step": step, "phase": phase_of(step - 1, cur)[1], "L": L,
                   "ans": round(st[2 * k] / acc["n"], 4), "lm": round(st[2 * k + 1] / acc["n"], 4),
                   "gnorm": round(st[2 * k + 2] / acc["n"], 3), "lr": lr_at(step - 1, a),
                   "per_task_ans": per, "t": round(time.time() - T0, 1)}
            history.append(rec)
            dt = time.time() - t_last
            t_last = time.time()
            log("step %d ph %s L %d ans %.4f lm %.4f gn %.2f lr %.2e | %s | %.3fs/step" %
                (step, rec["phase"], L, rec["ans"], rec["lm"], rec["gnorm"], rec["lr"],
                 " ".join("%s=%s" % (k2, v) for k2, v in per.items()), dt / max(1, acc["n"])))
            acc = {"n": 0}
        if step >= stop:
            break
    train_s = time.time() - t_train
    log("trained %d steps this run in %.1fs; now at step %d" % (steps_this_run, train_s, step))
    log("per-phase step time:", {k: "%d steps, %.3fs/step" % (v[0], v[1] / v[0])
                                 for k, v in phase_time.items()})
    del loader
    runs = []
    if a.resume:  # noqa: SIM102
        runs = load_ckpt(a.resume)["extra"].get("runs", [])
    runs.append({"steps": steps_this_run, "train_s": round(train_s, 1), "end_step": step})
    extra = {"history": history, "runs": runs}
    save_ckpt(os.path.join(a.out, "ckpt"), model, opt, step, extra)

    results = {}
    if a.quick_eval:
        results["quick"] = evaluate(model, device, [int(x) for x in a.quick_lengths.split(",")],
                                    a.quick_eval, pool=pool, deadline=T0 + a.deadline_s,
                                    dump=os.path.join(a.out, "eval_quick.json"))
    if a.export or a.final_eval:
        # evaluate and export the bf16-rounded weights (what the card describes)
        with torch.no_grad():
            for prm in model.parameters():
                prm.copy_(prm.to(torch.bfloat16).float())
    if a.export:
        export(model, a.export, device)
        import shutil
        os.makedirs(os.path.join(a.out, "model"), exist_ok=True)
        for f in ("config.json", "model.safetensors"):
            shutil.copy(os.path.join(a.export, f), os.path.join(a.out, "model", f))
    if a.final_eval:
        lens = [int(x) for x in a.final_lengths.split(",")]
        nb = {32768: a.n_32k} if a.n_32k is not None else None
        results["final"] = evaluate(model, device, lens, a.final_eval, pool=pool, n_by_len=nb,
                                    deadline=T0 + a.deadline_s,
                                    dump=os.path.join(a.out, "eval_final.json"))
    results["history_tail"] = history[-5:]
    results["runs"] = runs
    results["step"] = step
    with open(os.path.join(a.out, "results.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    log("done, total %.1fs" % (time.time() - T0))
    if pool:
        pool.terminate()


def export(model, path, device):
    from model import to_hf
    hf = to_hf(model, torch.bfloat16)
    hf.save_pretrained(path, safe_serialization=True)
    # reload and compare against our model (both bf16 weights, fp32 compute)
    from transformers import LlamaForCausalLM
    re = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (1, 512), generator=g)
    ids[0, 0] = tasks.BOS
    ids = ids.to(device)
    with torch.no_grad():
        d = (re(input_ids=ids).logits.float() - model(ids).float()).abs().max().item()
    log("export to %s: files %s; reload max |logit diff| vs trainer model %.2e" %
        (path, {f: os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)}, d))


if __name__ == "__main__":
    main()
