#!/usr/bin/env python3
"""Builds tiny random Hugging Face checkpoints and records transformers' own outputs on them.

The data is the reference for tests/hf_reference_test.cc: our CPU model runtime must load each
checkpoint (both config forms) and reproduce transformers' last-position logits and greedy tokens.

    python3 tools/hf_reference/make_hf_reference.py --out /tmp/hf [--tar $OUT/hf.tar.gz]

Needs torch, transformers (5.x; 4.x should work too) and safetensors. Deterministic: fixed seeds,
computation in float32 on the CPU with eager attention. Writes, per model,
  <out>/<name>/config.json          as transformers' save_pretrained wrote it
  <out>/<name>/config.classic.json  the same config in the classic transformers-4 form
                                    (rope_theta + rope_scaling, no rope_parameters)
  <out>/<name>/model.safetensors    bf16 weights (every parameter was rounded to bf16 before the
                                    reference was computed, so fp32 math on them is exact)
  <out>/<name>/generation_config.json
  <out>/<name>/reference.json       prompts, last-position logits, greedy tokens, margins, mutations

Models:
  llama3_gqa  LlamaForCausalLM: vocab 256, hidden 64, 3 layers, 8 query / 2 KV heads, explicit
              head_dim 16 (!= hidden/heads = 8, so the explicit-head_dim path is exercised:
              q_proj is [128, 64], o_proj [64, 128]), intermediate 192, untied LM head, RoPE theta
              1e4 with Llama-3.1 `llama3` scaling (factor 8, low 1, high 4, original max 32): with
              head_dim 16 the wavelengths are 6.3 (high band, kept), 19.9 (smoothed band) and
              62.8..19869 (low band, divided by 8), so prompts of up to 100 tokens exercise all three.
  qwen2_tied  Qwen2ForCausalLM: vocab 256, hidden 64, 3 layers, 4 query / 2 KV heads (head_dim 16),
              intermediate 192, tied embeddings, q/k/v biases, RoPE theta 1e4, no sliding window.

If a seed gives a greedy step whose top-1/top-2 logit margin is below --min-margin (near-ties make
token-equality tests flaky), or a mutation that is not clearly detectable, the next seed is tried;
the seed used is recorded in reference.json.
"""

import argparse
import copy
import json
import math
import os
import random
import shutil
import sys
import tarfile
import tempfile

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

PROMPT_LENGTHS = [1, 7, 33, 64, 100]
GREEDY_STEPS = 16
VOCAB = 256
# Test tolerance (mirrored in tests/hf_reference_test.cc): max|ours - ref| <= 1e-3 * max(1, max|ref|).
REL_TOL = 1e-3
# A mutation must move the logits by more than this many tolerances to count as detectable.
MUTATION_FACTOR = 100.0

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def log(*args):
    print(*args, flush=True)


def tolerance(ref_logits):
    return REL_TOL * max(1.0, max(abs(x) for x in ref_logits))


# ----------------------------------------------------------------------------------------------
# Configs


def llama_kwargs(rope):
    return dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=1,
        eos_token_id=2,
        rope=rope,
    )


def qwen2_kwargs(rope):
    return dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_act="silu",
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        use_sliding_window=False,
        bos_token_id=1,
        eos_token_id=2,
        rope=rope,
    )


def make_config(cls, kwargs):
    """Builds a config with RoPE given in whichever form this transformers accepts."""
    cls = {LlamaForCausalLM: LlamaConfig, Qwen2ForCausalLM: Qwen2Config}.get(cls, cls)
    kwargs = dict(kwargs)
    rope = dict(kwargs.pop("rope"))
    try:
        cfg = cls(rope_parameters=dict(rope), **kwargs)  # transformers 5
    except TypeError:
        theta = rope.pop("rope_theta")
        scaling = None if rope["rope_type"] == "default" else rope
        cfg = cls(rope_theta=theta, rope_scaling=scaling, **kwargs)  # transformers 4
    try:
        cfg._attn_implementation = "eager"
    except Exception as e:  # noqa: BLE001
        log("note: could not set config._attn_implementation:", e)
    return cfg


def build_model(cls, cfg):
    model = cls(cfg)
    if hasattr(model, "set_attn_implementation"):
        try:
            model.set_attn_implementation("eager")
        except Exception as e:  # noqa: BLE001
            log("note: set_attn_implementation failed:", e)
    return model.to(torch.float32).eval()


# ----------------------------------------------------------------------------------------------
# Weights


@torch.no_grad()
def init_weights(model, seed, lin_std, emb_std, head_std, bias_std, norm_spread):
    """Non-flat random weights, every parameter rounded to bf16 (so the bf16 save is lossless)."""
    gen = torch.Generator().manual_seed(seed)
    names = []
    for name, p in model.named_parameters():  # shared (tied) parameters appear once
        names.append(name)
        shape = p.shape
        if name.endswith("norm.weight"):
            v = 1.0 + norm_spread * (2.0 * torch.rand(shape, generator=gen) - 1.0)
        elif name.endswith("embed_tokens.weight"):
            v = emb_std * torch.randn(shape, generator=gen)
        elif name.startswith("lm_head"):
            v = head_std * torch.randn(shape, generator=gen)
        elif name.endswith(".bias"):
            v = bias_std * torch.randn(shape, generator=gen)
        elif name.endswith(".weight"):
            v = lin_std * torch.randn(shape, generator=gen)
        else:
            raise RuntimeError(f"unexpected parameter {name}")
        p.data.copy_(v.to(torch.bfloat16).to(torch.float32))
    for p in model.parameters():
        assert torch.equal(p.data, p.data.to(torch.bfloat16).to(torch.float32))
    return names


# ----------------------------------------------------------------------------------------------
# Running


@torch.no_grad()
def last_logits(model, ids):
    out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False)
    return out.logits[0, -1]


@torch.no_grad()
def greedy(model, prompt, steps):
    """Greedy decode by full forward passes (no KV cache, no generate()); returns tokens, margins."""
    ids = list(prompt)
    toks, margins = [], []
    for _ in range(steps):
        logits = last_logits(model, ids)
        top = torch.topk(logits, 2)
        nxt = int(torch.argmax(logits))
        assert nxt == int(top.indices[0])
        toks.append(nxt)
        margins.append(float(top.values[0] - top.values[1]))
        ids.append(nxt)
    return toks, margins


def make_prompts(seed):
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in PROMPT_LENGTHS]


@torch.no_grad()
def copy_params(dst, src):
    """Copies parameters only (not RoPE buffers, which must come from dst's own config)."""
    sp, dp = dict(src.named_parameters()), dict(dst.named_parameters())
    assert sp.keys() == dp.keys(), (sorted(sp.keys() ^ dp.keys()))
    for k, v in sp.items():
        dp[k].copy_(v)


def check_rope(model, rope, what):
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    inv, exp = rope_inv_freq(model), expected_inv_freq(rope, head_dim)
    ok = inv is not None and len(inv) == len(exp) and max(abs(a - b) / b for a, b in zip(inv, exp)) < 1e-5
    if not ok:
        log(f"WARNING {what}: inv_freq {inv} != expected {exp}")
    return ok


def max_abs(a, b):
    return float((a.double() - b.double()).abs().max())


def rope_inv_freq(model):
    rot = getattr(model.model, "rotary_emb", None)
    if rot is None or not hasattr(rot, "inv_freq"):
        return None
    return [float(x) for x in rot.inv_freq.float()]


def expected_inv_freq(rope, head_dim):
    base = [1.0 / rope["rope_theta"] ** (i / head_dim) for i in range(0, head_dim, 2)]
    if rope["rope_type"] == "default":
        return base
    assert rope["rope_type"] == "llama3"
    factor, lo, hi = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for f in base:
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            out.append(f)
        elif wavelen > old / lo:
            out.append(f / factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out


# ----------------------------------------------------------------------------------------------
# Saving


def save_checkpoint(model, d):
    m = copy.deepcopy(model).to(torch.bfloat16)
    try:
        m.save_pretrained(d, safe_serialization=True)
    except TypeError:
        m.save_pretrained(d)  # a transformers without the argument always writes safetensors


def classic_config(cfg_json):
    """config.json (transformers 5 form) -> classic form: rope_theta + rope_scaling."""
    c = copy.deepcopy(cfg_json)
    if "rope_parameters" in c:
        rp = dict(c.pop("rope_parameters"))
        if "rope_type" not in rp and "full_attention" in rp:  # per-layer-type nesting
            rp = dict(rp["full_attention"])
        c["rope_theta"] = rp.pop("rope_theta")
        rtype = rp.get("rope_type", rp.get("type", "default"))
        rp.pop("type", None)
        if rp.get("partial_rotary_factor", 1.0) in (None, 1.0):
            rp.pop("partial_rotary_factor", None)
        c["rope_scaling"] = None if rtype == "default" else rp
    else:
        c.setdefault("rope_scaling", None)
    return c


def load_pretrained(cls, d):
    kw = dict(attn_implementation="eager")
    try:
        m = cls.from_pretrained(d, dtype=torch.float32, **kw)
    except TypeError:
        m = cls.from_pretrained(d, torch_dtype=torch.float32, **kw)
    return m.to(torch.float32).eval()


# ----------------------------------------------------------------------------------------------


def attempt(name, cls, kwargs_fn, rope, seed, init, out_dir, min_margin):
    """Builds, saves and measures one candidate. Returns (ok, reference dict)."""
    torch.manual_seed(seed)
    cfg = make_config(cls, kwargs_fn(rope))
    model = build_model(cls, cfg)
    if cfg.tie_word_embeddings:
        def tied():
            return model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        if not tied():
            model.tie_weights()
        assert tied(), "lm_head is not tied to embed_tokens"
    param_names = init_weights(model, seed, **init)

    d = os.path.join(out_dir, name)
    if os.path.exists(d):
        shutil.rmtree(d)
    save_checkpoint(model, d)

    # The reference is computed from the checkpoint as transformers loads it back (fp32).
    ref = load_pretrained(cls, d)
    sd0, sd1 = model.state_dict(), ref.state_dict()
    for k in sd0:
        if k in sd1:
            assert torch.equal(sd0[k], sd1[k]), f"reload changed {k}"
    log(f"[{name} seed {seed}] attn_implementation={getattr(ref.config, '_attn_implementation', '?')}")

    inv = rope_inv_freq(ref)
    inv_ok = check_rope(ref, rope, name)

    prompts = make_prompts(1000 + seed)
    logits, toks, margins = [], [], []
    for p in prompts:
        logits.append(last_logits(ref, p))
        t, m = greedy(ref, p, GREEDY_STEPS)
        toks.append(t)
        margins.append(m)
        assert t[0] == int(torch.argmax(logits[-1]))
    min_m = min(min(m) for m in margins)

    # fp64 cross-check: how far fp32 itself is from exact, and greedy must not change.
    ref64 = copy.deepcopy(ref).to(torch.float64)
    fp64_delta = max(max_abs(last_logits(ref64, p), l) for p, l in zip(prompts, logits))
    fp64_greedy_same = all(greedy(ref64, p, GREEDY_STEPS)[0] == t for p, t in zip(prompts, toks))

    # The classic config form must mean the same to transformers.
    with open(os.path.join(d, "config.json")) as f:
        cfg_json = json.load(f)
    classic = classic_config(cfg_json)
    with open(os.path.join(d, "config.classic.json"), "w") as f:
        json.dump(classic, f, indent=2, sort_keys=True)
        f.write("\n")
    classic_delta, classic_inv = None, None
    try:
        with tempfile.TemporaryDirectory() as td:
            shutil.copy(os.path.join(d, "model.safetensors"), td)
            with open(os.path.join(td, "config.json"), "w") as f:
                json.dump(classic, f)
            cm = load_pretrained(cls, td)
            classic_delta = max(max_abs(last_logits(cm, p), l) for p, l in zip(prompts, logits))
            classic_inv = rope_inv_freq(cm)
    except Exception as e:  # noqa: BLE001
        log(f"WARNING [{name}]: transformers could not load config.classic.json: {e!r}")
        classic_delta = f"load failed: {e!r}"

    # Mutations, on the longest prompt.
    longest, long_ref = prompts[-1], logits[-1]
    mutations = {}
    if name.startswith("llama"):
        mcfg = make_config(cls, kwargs_fn({"rope_type": "default", "rope_theta": rope["rope_theta"]}))
        mm = build_model(cls, mcfg)
        copy_params(mm, ref)
        check_rope(mm, {"rope_type": "default", "rope_theta": rope["rope_theta"]}, "rope-ignored mutant")
        mutations["rope_scaling_ignored"] = max_abs(last_logits(mm, longest), long_ref)
        mutations["rope_scaling_ignored_per_prompt"] = [
            max_abs(last_logits(mm, p), l) for p, l in zip(prompts, logits)]
        primary = "rope_scaling_ignored"
    else:
        mm = copy.deepcopy(ref)
        with torch.no_grad():
            for layer in mm.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.zero_()
        mutations["qkv_bias_zeroed"] = max_abs(last_logits(mm, longest), long_ref)
        primary = "qkv_bias_zeroed"
    # Both: RoPE theta doubled (the test's mutation for qwen2, where the API has no bias knob).
    r2 = dict(rope)
    r2["rope_theta"] = 2 * rope["rope_theta"]
    mm = build_model(cls, make_config(cls, kwargs_fn(r2)))
    copy_params(mm, ref)
    check_rope(mm, r2, "theta-doubled mutant")
    mutations["rope_theta_doubled"] = max_abs(last_logits(mm, longest), long_ref)

    tol_long = tolerance([float(x) for x in long_ref])
    need = MUTATION_FACTOR * tol_long
    ok = (min_m >= min_margin and fp64_greedy_same
          and mutations[primary] > need and mutations["rope_theta_doubled"] > need)
    if classic_delta != 0.0:  # also when the load failed (a string)
        log(f"WARNING [{name}]: config.classic.json changes transformers' logits by {classic_delta}")
    log(f"[{name} seed {seed}] min_margin={min_m:.4g} fp64_delta={fp64_delta:.3g} "
        f"fp64_greedy_same={fp64_greedy_same} classic_delta={classic_delta} "
        f"mutations={ {k: v for k, v in mutations.items() if not k.endswith('per_prompt')} } "
        f"need>{need:.3g} -> {'OK' if ok else 'retry'}")

    max_ref = max(max(abs(float(x)) for x in l) for l in logits)
    reference = {
        "model": name,
        "architecture": cls.__name__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "seed": seed,
        "weight_init": dict(init, note="normal(0,std) weights/biases, norms uniform(1-s,1+s), "
                                       "all rounded to bf16; saved as bf16"),
        "parameter_names": param_names,
        "prompts": prompts,
        "last_logits": [[float(x) for x in l] for l in logits],
        "greedy": toks,
        "greedy_margins": margins,
        "min_margin": min_m,
        "criteria_met": ok,
        "max_abs_ref_logit": max_ref,
        "tolerance_rule": "max|ours-ref| <= 1e-3 * max(1, max|ref|) per prompt",
        "fp32_vs_fp64_max_abs_logit_delta": fp64_delta,
        "fp64_greedy_identical": fp64_greedy_same,
        "classic_config_max_abs_logit_delta": classic_delta,
        "rope_inv_freq": inv,
        "rope_inv_freq_matches_own_formula": inv_ok,
        "rope_inv_freq_classic_config": classic_inv,
        "mutation": primary,
        "mutation_max_abs_logit_delta": mutations[primary],
        "mutations": mutations,
        "notes": (
            "Logits: transformers " + transformers.__version__ + ", float32 on the CPU, eager "
            "attention, full forward passes without KV cache (use_cache=False) on the checkpoint "
            "reloaded with from_pretrained(dtype=float32). greedy: own argmax loop of 16 steps of "
            "full forward passes, not generate(). greedy_margins: top1-top2 logit at each step. "
            "mutation_max_abs_logit_delta: max |delta logit| on the longest prompt's last position "
            "when " + ("the llama3 rope scaling is ignored (rope_type default, same theta)"
                       if primary == "rope_scaling_ignored" else "the q/k/v biases are zeroed")
            + "; mutations.rope_theta_doubled: same with rope theta x2. "
            "config.classic.json is config.json with rope_parameters replaced by rope_theta + "
            "rope_scaling; transformers gives bit-identical logits with it "
            "(classic_config_max_abs_logit_delta)."
        ),
    }
    return ok, reference


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tar", default=None, help="also write a .tar.gz of the whole --out tree")
    ap.add_argument("--min-margin", type=float, default=0.02)
    ap.add_argument("--max-tries", type=int, default=60)
    args = ap.parse_args()

    torch.set_num_threads(min(8, os.cpu_count() or 1))
    torch.use_deterministic_algorithms(True, warn_only=True)
    if hasattr(torch.backends, "cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
    log("transformers", transformers.__version__, "torch", torch.__version__, "python", sys.version.split()[0])
    try:
        import safetensors
        log("safetensors", safetensors.__version__)
    except ImportError:
        log("safetensors: NOT importable")

    os.makedirs(args.out, exist_ok=True)
    # Logits come out with a spread of several units (head/embedding std 0.8 over 64 dims), so
    # top-1/top-2 near-ties are rare; biases std 0.5 so that q/k/v biases matter.
    init = dict(lin_std=0.2, emb_std=0.8, head_std=0.8, bias_std=0.5, norm_spread=0.2)
    specs = [
        ("llama3_gqa", LlamaForCausalLM, llama_kwargs, LLAMA3_ROPE, 11),
        ("qwen2_tied", Qwen2ForCausalLM, qwen2_kwargs, {"rope_type": "default", "rope_theta": 10000.0}, 21),
    ]
    summary = {}
    for name, cls, kw, rope, seed0 in specs:
        best, best_seed = None, None
        for seed in range(seed0, seed0 + args.max_tries):
            ok, reference = attempt(name, cls, kw, rope, seed, init, args.out, args.min_margin)
            if ok:
                best = reference
                break
            if best_seed is None or reference["min_margin"] > best["min_margin"]:
                best, best_seed = reference, seed
        if not best["criteria_met"]:
            # Keep the data (one device run is precious) but say so loudly.
            log(f"WARNING {name}: no seed in {args.max_tries} met the criteria; rebuilding seed {best_seed}")
            _, best = attempt(name, cls, kw, rope, best_seed, init, args.out, args.min_margin)
        with open(os.path.join(args.out, name, "reference.json"), "w") as f:
            json.dump(best, f, indent=1)
            f.write("\n")
        summary[name] = {k: best[k] for k in ("seed", "min_margin", "mutation", "mutation_max_abs_logit_delta",
                                              "mutations", "fp32_vs_fp64_max_abs_logit_delta",
                                              "max_abs_ref_logit", "greedy")}
        summary[name]["mutations"] = {k: v for k, v in best["mutations"].items()}

    # What was written, for the README.
    from safetensors import safe_open
    for name, *_ in specs:
        d = os.path.join(args.out, name)
        log(f"==== {name}")
        for fn in sorted(os.listdir(d)):
            log(f"  {fn}: {os.path.getsize(os.path.join(d, fn))} bytes")
        for fn in ("config.json", "config.classic.json", "generation_config.json"):
            p = os.path.join(d, fn)
            if os.path.exists(p):
                log(f"---- {fn}")
                log(open(p).read())
        try:
            with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
                log("---- safetensors metadata:", f.metadata())
                for k in f.keys():
                    t = f.get_tensor(k)
                    log(f"  {k} {t.dtype} {list(t.shape)}")
        except Exception as e:  # noqa: BLE001
            log("could not list safetensors:", repr(e))
    log("==== summary")
    log(json.dumps(summary, indent=1))

    if args.tar:
        with tarfile.open(args.tar, "w:gz") as tf:
            tf.add(args.out, arcname=os.path.basename(os.path.normpath(args.out)))
        log("wrote", args.tar, os.path.getsize(args.tar), "bytes")


if __name__ == "__main__":
    main()
