"""A Llama decoder in plain PyTorch whose parameter names and arithmetic match transformers'
``LlamaForCausalLM`` (checked against it on the GPU machine before training: see
``check_against_hf``), plus a batched greedy decoder with a KV cache for evaluation.

Parameter names: model.embed_tokens.weight, model.layers.{i}.input_layernorm.weight,
model.layers.{i}.self_attn.{q,k,v,o}_proj.weight, model.layers.{i}.post_attention_layernorm.weight,
model.layers.{i}.mlp.{gate,up,down}_proj.weight, model.norm.weight; lm_head tied to embed_tokens.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

CONFIG = dict(
    vocab_size=264,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=32768,
    bos_token_id=256,
    eos_token_id=257,
    pad_token_id=258,
    tie_word_embeddings=True,
)

HAS_SDPA = hasattr(F, "scaled_dot_product_attention")


class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


def rope_cos_sin(pos, head_dim, theta, dtype):
    """pos: LongTensor [...]; returns cos, sin [..., head_dim] (HF layout: halves duplicated)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.int64)
                           .float() / head_dim))
    f = pos.float()[..., None] * inv
    emb = torch.cat((f, f), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rope(x, cos, sin):
    return x * cos + rotate_half(x) * sin


def causal_attention(q, k, v):
    """q [B,H,T,D], k/v [B,Hkv,T,D]; full causal attention."""
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k = k.repeat_interleave(g, dim=1)
        v = v.repeat_interleave(g, dim=1)
    if HAS_SDPA:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    T = q.shape[2]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    m = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    s = s.float().masked_fill(m, float("-inf")).softmax(-1).to(q.dtype)
    return s @ v


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.h, self.hkv, self.d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        hs = c["hidden_size"]
        self.q_proj = nn.Linear(hs, self.h * self.d, bias=False)
        self.k_proj = nn.Linear(hs, self.hkv * self.d, bias=False)
        self.v_proj = nn.Linear(hs, self.hkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, hs, bias=False)

    def qkv(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.h, self.d).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.hkv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.hkv, self.d).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        return q, k, v

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q, k, v = self.qkv(x, cos, sin)
        o = causal_attention(q, k, v)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.h * self.d)), k, v


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        hs, i = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(hs, i, bias=False)
        self.up_proj = nn.Linear(hs, i, bias=False)
        self.down_proj = nn.Linear(i, hs, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = MLP(c)


class Inner(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList([Layer(c) for _ in range(c["num_hidden_layers"])])
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class Llama(nn.Module):
    def __init__(self, c=CONFIG):
        super().__init__()
        self.c = dict(c)
        self.model = Inner(self.c)
        self.init_weights()

    def init_weights(self, std=0.02):
        # HF's LlamaPreTrainedModel init: normal(0, initializer_range=0.02), norms 1.
        for n, p in self.named_parameters():
            if n.endswith("layernorm.weight") or n == "model.norm.weight":
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, 0.0, std)

    def hidden(self, ids, pos=None, want_kv=False):
        B, T = ids.shape
        if pos is None:
            pos = torch.arange(T, device=ids.device)
        x = self.model.embed_tokens(ids)
        dt = x.dtype
        if ids.is_cuda and torch.is_autocast_enabled():
            dt = torch.get_autocast_dtype("cuda") if hasattr(torch, "get_autocast_dtype") \
                else torch.get_autocast_gpu_dtype()
        cos, sin = rope_cos_sin(pos, self.c["head_dim"], self.c["rope_theta"], dt)
        kvs = []
        for L in self.model.layers:
            a, k, v = L.self_attn(L.input_layernorm(x), cos, sin)
            if want_kv:
                kvs.append((k, v))
            x = x + a
            x = x + L.mlp(L.post_attention_layernorm(x))
        return self.model.norm(x), kvs

    def logits(self, h):
        return F.linear(h, self.model.embed_tokens.weight)

    def forward(self, ids):
        h, _ = self.hidden(ids)
        return self.logits(h)


def n_params(m):
    return sum(p.numel() for p in m.parameters())


# ---------------------------------------------------------------------------------------------
# Batched greedy decoding with a KV cache
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def greedy_generate(m, prompts, max_new, device, stop_ids=(10, 257)):
    """prompts: list of lists of token ids (BOS included), different lengths allowed.
    Each prompt is prefilled alone (full causal attention, no padding), its K/V written into one
    batched cache; then all samples decode together, one token a step, with a per-sample position
    and a mask of valid cache slots. Returns a list of generated id lists (stopped at the first
    stop id, which is included)."""
    c = m.c
    B = len(prompts)
    nl, hkv, d, h = c["num_hidden_layers"], c["num_key_value_heads"], c["head_dim"], \
        c["num_attention_heads"]
    g = h // hkv
    lens = torch.tensor([len(p) for p in prompts], device=device)
    S = int(lens.max()) + max_new
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    kc = [torch.zeros(B, hkv, S, d, device=device, dtype=dt) for _ in range(nl)]
    vc = [torch.zeros(B, hkv, S, d, device=device, dtype=dt) for _ in range(nl)]
    first = torch.empty(B, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        ids = torch.tensor(p, device=device)[None]
        hdn, kvs = m.hidden(ids, want_kv=True)
        for i, (k, v) in enumerate(kvs):
            kc[i][b, :, :len(p)] = k[0].to(dt)
            vc[i][b, :, :len(p)] = v[0].to(dt)
        first[b] = m.logits(hdn[:, -1]).argmax(-1)[0]
    out = [first]
    done = torch.zeros(B, dtype=torch.bool, device=device)
    for sid in stop_ids:
        done |= first == sid
    tok = first
    pos = lens.clone()  # position of the token being fed
    ar = torch.arange(B, device=device)
    slots = torch.arange(S, device=device)
    for step in range(max_new - 1):
        if bool(done.all()):
            break
        x = m.model.embed_tokens(tok)[:, None]  # [B,1,H]
        cos, sin = rope_cos_sin(pos[:, None, None], d, c["rope_theta"], x.dtype if device.type != "cuda" else dt)
        # cos/sin: [B,1,1,D] broadcast over heads
        mask = (slots[None, :] <= pos[:, None])[:, None, None, :]  # [B,1,1,S]
        smax = int(pos.max()) + 1
        mask = mask[..., :smax]
        for i, L in enumerate(m.model.layers):
            a = L.self_attn
            xn = L.input_layernorm(x)
            q = a.q_proj(xn).view(B, 1, h, d).transpose(1, 2)
            k = a.k_proj(xn).view(B, 1, hkv, d).transpose(1, 2)
            v = a.v_proj(xn).view(B, 1, hkv, d).transpose(1, 2)
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
            kc[i][ar, :, pos] = k[:, :, 0].to(dt)
            vc[i][ar, :, pos] = v[:, :, 0].to(dt)
            # GQA without copying K/V: the g query heads sharing a KV head become g query rows.
            qg = q.reshape(B, hkv, g, d).to(dt)
            K = kc[i][:, :, :smax]
            V = vc[i][:, :, :smax]
            if HAS_SDPA:
                o = F.scaled_dot_product_attention(qg, K, V, attn_mask=mask)
            else:
                s = (qg.float() @ K.float().transpose(-1, -2)) / math.sqrt(d)
                s = s.masked_fill(~mask, float("-inf")).softmax(-1)
                o = s @ V.float()
            o = o.reshape(B, 1, h * d).to(x.dtype)
            x = x + a.o_proj(o)
            x = x + L.mlp(L.post_attention_layernorm(x))
        tok = m.logits(m.model.norm(x))[:, 0].argmax(-1)
        tok = torch.where(done, torch.full_like(tok, 258), tok)
        out.append(tok)
        for sid in stop_ids:
            done |= tok == sid
        pos = pos + 1
    gen = torch.stack(out, 1).tolist()
    res = []
    for row in gen:
        r = []
        for t in row:
            r.append(t)
            if t in stop_ids:
                break
        res.append(r)
    return res


# ---------------------------------------------------------------------------------------------
# transformers interop (GPU machine only)
# ---------------------------------------------------------------------------------------------
def hf_config(c=CONFIG):
    """transformers LlamaConfig for ``c``; RoPE as transformers 5 ``rope_parameters`` (default
    type, no scaling) where the installed version has it, else the classic ``rope_theta``."""
    from transformers import LlamaConfig
    kw = dict(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"], num_hidden_layers=c["num_hidden_layers"],
        num_attention_heads=c["num_attention_heads"], num_key_value_heads=c["num_key_value_heads"],
        head_dim=c["head_dim"], hidden_act="silu", max_position_embeddings=c["max_position_embeddings"],
        rms_norm_eps=c["rms_norm_eps"], attention_bias=False,
        mlp_bias=False, tie_word_embeddings=True, bos_token_id=c["bos_token_id"],
        eos_token_id=c["eos_token_id"], pad_token_id=c["pad_token_id"], initializer_range=0.02,
        attn_implementation="sdpa")
    theta = float(c["rope_theta"])
    try:
        cfg = LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": theta}, **kw)
    except TypeError:
        cfg = LlamaConfig(rope_theta=theta, **kw)
    if getattr(cfg, "rope_parameters", None) is None:
        cfg.rope_theta = theta
    return cfg


def hf_theta(cfg):
    rp = getattr(cfg, "rope_parameters", None) or {}
    return rp.get("rope_theta", getattr(cfg, "rope_theta", None))


def to_hf(m, dtype=torch.float32):
    from transformers import LlamaForCausalLM
    cfg = hf_config(m.c)
    hf = LlamaForCausalLM(cfg)
    sd = {k: v.detach().to(dtype) for k, v in m.state_dict().items()}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]
    assert not missing and not unexpected, (missing, unexpected)
    hf = hf.to(dtype)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr(), "lm_head not tied"
    return hf


@torch.no_grad()
def check_against_hf(m, device, T=300):
    """Max |logit difference| between this model and transformers' LlamaForCausalLM holding the
    same weights, fp32, no autocast; also checks the cached greedy decoder against HF's greedy."""
    hf = to_hf(m).to(device).eval()
    theta = hf_theta(hf.config)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, T), generator=g).to(device)
    ids[:, 0] = 256
    a = m(ids).float()
    b = hf(input_ids=ids).logits.float()
    diff = (a - b).abs().max().item()
    return diff, float(theta)
