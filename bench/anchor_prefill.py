"""Anchor: prefill time of Llama-3.1-8B shapes in torch (bf16 weights, SDPA causal attention).

What `fluxion bench prefill --device cuda` is compared with (issue 15): the whole prompt through
the 32 layers and the last row's LM head, as a torch user would run it, with flash / cuDNN SDPA
(is_causal, GQA), in chunks of --chunk rows over a KV cache in HBM as our GPU prefill runs
(0: the whole prompt at once). Also the causal SDPA alone per layer at each length, the kernel our
flash-style attention is measured against. Random weights (timing only); RoPE left out
(elementwise). One JSON line per context, then a table.
Usage (on the H200 machine, in the same call as the bench):
  python3 anchor_prefill.py [--contexts 8192,32768,65536,131072] [--chunk 2048] [--json FILE]
"""
import argparse, json, time
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

H, L, NQ, NKV, D, FF, V = 4096, 32, 32, 8, 128, 14336, 128256
BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def rms(x, w):
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * w


def make_weights(dev):
    g = torch.Generator(device=dev).manual_seed(0)
    def r(*s):
        return torch.randn(*s, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    layers = [dict(qkv=r((NQ + 2 * NKV) * D, H), o=r(H, NQ * D), gu=r(2 * FF, H), down=r(H, FF),
                   n1=torch.ones(H, device=dev, dtype=torch.bfloat16),
                   n2=torch.ones(H, device=dev, dtype=torch.bfloat16)) for _ in range(L)]
    return layers, r(V, H), torch.ones(H, device=dev, dtype=torch.bfloat16)


def attend(q, k, v, causal):
    with sdpa_kernel(BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def prefill(x_all, layers, head, nf, chunk, kc, vc):
    T = x_all.shape[0]
    step = T if chunk <= 0 else chunk
    out = None
    for c0 in range(0, T, step):
        x = x_all[c0:c0 + step]
        n = x.shape[0]
        for i, w in enumerate(layers):
            h = rms(x, w["n1"])
            q, k, v = (h @ w["qkv"].t()).split([NQ * D, NKV * D, NKV * D], dim=-1)
            kc[i][:, c0:c0 + n] = k.view(n, NKV, D).transpose(0, 1)
            vc[i][:, c0:c0 + n] = v.view(n, NKV, D).transpose(0, 1)
            qh = q.view(n, NQ, D).transpose(0, 1).unsqueeze(0)
            keys, vals = kc[i][:, :c0 + n].unsqueeze(0), vc[i][:, :c0 + n].unsqueeze(0)
            if c0 == 0:
                a = attend(qh, keys, vals, True)
            else:  # rows c0.. see every earlier key: an explicit causal mask for the chunk
                mask = torch.ones(n, c0 + n, device=x.device, dtype=torch.bool).tril(c0)
                with sdpa_kernel(BACKENDS):
                    a = F.scaled_dot_product_attention(qh, keys, vals, attn_mask=mask, enable_gqa=True)
            x = x + a.squeeze(0).transpose(0, 1).reshape(n, NQ * D) @ w["o"].t()
            gt, up = (rms(x, w["n2"]) @ w["gu"].t()).chunk(2, dim=-1)
            x = x + (F.silu(gt) * up) @ w["down"].t()
        out = x[-1:]
    return rms(out, nf) @ head.t()


def timed(fn, iters=1):
    fn(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="8192,32768,65536,131072")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = "cuda"
    layers, head, nf = make_weights(dev)
    print(json.dumps({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}))
    rows = []
    for T in map(int, args.contexts.split(",")):
        kc = [torch.empty(NKV, T, D, device=dev, dtype=torch.bfloat16) for _ in range(L)]
        vc = [torch.empty(NKV, T, D, device=dev, dtype=torch.bfloat16) for _ in range(L)]
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        whole = timed(lambda: prefill(x, layers, head, nf, args.chunk, kc, vc))
        q = torch.randn(1, NQ, T, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, NKV, T, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn(1, NKV, T, D, device=dev, dtype=torch.bfloat16)
        sdpa = timed(lambda: attend(q, k, v, True), 3)
        flops = 4 * NQ * D * T * T / 2  # causal QK^T and PV
        rows.append(dict(context=T, chunk=args.chunk, prefill_s=round(whole, 3), tok_per_s=round(T / whole),
                         sdpa_layer_ms=round(sdpa * 1e3, 3), sdpa_tflops=round(flops / sdpa / 1e12, 1)))
        print(json.dumps(rows[-1]), flush=True)
        del kc, vc, x, q, k, v
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                       "what": "torch prefill, Llama-3.1-8B shapes, SDPA causal, chunked", "rows": rows}, f, indent=1)
    print("\n| context | chunk | torch prefill s | tok/s | causal SDPA per layer ms | SDPA TFLOP/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']} | {r['chunk']} | {r['prefill_s']} | {r['tok_per_s']} | {r['sdpa_layer_ms']} | {r['sdpa_tflops']} |")


if __name__ == "__main__":
    main()
