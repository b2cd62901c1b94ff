"""An independent plain reference of the DeepSeek-V3 forward, for tests only.

Non-absorbed MLA: per-head keys [k_nope = W_UK c_t, k_rope] and values W_UV c_t are
materialized from kv_b_proj, there is no cache, causal softmax; everything in float64.
Reads the checkpoint with its own safetensors parser (bf16 through ml_dtypes) and the raw
config.json, so it shares no code with workers/.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np

_DT = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32}


def read_checkpoint(d: Path) -> dict[str, np.ndarray]:
    files = [d / "model.safetensors"]
    if (d / "model.safetensors.index.json").exists():
        wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
        files = [d / f for f in sorted(set(wm.values()))]
    out = {}
    for f in files:
        raw = f.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        for name, info in header.items():
            if name == "__metadata__":
                continue
            a, b = info["data_offsets"]
            arr = np.frombuffer(raw[8 + n + a:8 + n + b], dtype=_DT[info["dtype"]])
            out[name] = arr.astype(np.float64).reshape(info["shape"])
    return out


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _silu(x):
    return x / (1 + np.exp(-x))


def _inv_freq_and_scales(c: dict):
    """(inv_freq [d/2], cos/sin factor, softmax scale) per YaRN as DeepSeek-V3 defines it."""
    d = c["qk_rope_head_dim"]
    base = c.get("rope_theta", 10000.0)
    scale = (c["qk_nope_head_dim"] + d) ** -0.5
    inv = 1.0 / base ** (np.arange(0, d, 2) / d)
    ys = c.get("rope_scaling")
    if not ys:
        return inv, 1.0, scale
    f, orig = ys["factor"], ys["original_max_position_embeddings"]
    bf, bs = ys.get("beta_fast", 32), ys.get("beta_slow", 1)

    def dim_for(rot):
        return d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = max(math.floor(dim_for(bf)), 0), min(math.ceil(dim_for(bs)), d - 1)
    ramp = np.clip((np.arange(d // 2) - lo) / ((hi - lo) or 0.001), 0, 1)
    inv = inv / f * ramp + inv * (1 - ramp)  # ramp 0 = extrapolate (high freq), 1 = interpolate

    def msc(m):
        return 1.0 if f <= 1 else 0.1 * m * math.log(f) + 1.0

    m, mad = ys.get("mscale"), ys.get("mscale_all_dim", 0.0)  # no mscale: att = msc(1), as transformers
    att = msc(m) / msc(mad) if (m and mad) else msc(1.0)
    if mad:
        scale *= msc(mad) ** 2
    return inv, att, scale


def _rotate(x, ang, interleave):
    """Rotate the last axis of x [T, ..., d] by angles ang [T, d/2]."""
    shape = (ang.shape[0],) + (1,) * (x.ndim - 2) + (ang.shape[1],)
    cos, sin = np.cos(ang).reshape(shape), np.sin(ang).reshape(shape)
    if interleave:  # complex multiply of (x0 + i x1) pairs, as DeepSeek's reference
        z = (x[..., 0::2] + 1j * x[..., 1::2]) * (cos + 1j * sin)
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
        return out
    h = x.shape[-1] // 2
    return np.concatenate([x[..., :h] * cos - x[..., h:] * sin, x[..., h:] * cos + x[..., :h] * sin], -1)


def _route(c, logits, bias):
    k, G = c["num_experts_per_tok"], c.get("n_group", 1)
    E = logits.shape[-1]
    if c.get("scoring_func", "sigmoid") == "sigmoid":
        s = 1 / (1 + np.exp(-logits))
    else:
        s = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    method = c.get("topk_method", "noaux_tc")
    ch = s + bias if method == "noaux_tc" else s.copy()
    if G > 1 and method in ("noaux_tc", "group_limited_greedy"):
        grp = ch.reshape(G, E // G)
        gs = np.sort(grp, -1)[:, -2:].sum(-1) if method == "noaux_tc" else grp.max(-1)
        keep = np.argsort(-gs, kind="stable")[: c["topk_group"]]
        mask = np.zeros(G, bool)
        mask[keep] = True
        ch = np.where(np.repeat(mask, E // G), ch, 0.0)  # (transformers' masked_fill value)
    idx = np.argsort(-ch, kind="stable")[:k]
    w = s[idx]
    if c.get("norm_topk_prob", True):
        w = w / (w.sum() + 1e-20)
    return idx, w * c.get("routed_scaling_factor", 1.0)


def reference_logits(model_dir: Path, ids: list[int], kv_roundtrip=None) -> np.ndarray:
    """Logits [T, vocab] (float64) of one causal pass over ids. kv_roundtrip(rows [T, n]) ->
    rows, when given, replaces the cached rows (latent after its norm, rope key after RoPE)
    by what a quantized cache gives back."""
    rt = kv_roundtrip or (lambda r: r)
    c = json.loads((Path(model_dir) / "config.json").read_text())
    w = read_checkpoint(Path(model_dir))
    T, nh = len(ids), c["num_attention_heads"]
    dn, dr, dv, kvr = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
    eps = c["rms_norm_eps"]
    inv, att, scale = _inv_freq_and_scales(c)
    ang = np.arange(T)[:, None] * inv[None, :]
    x = w["model.embed_tokens.weight"][ids]
    causal = np.tril(np.ones((T, T), bool))
    for i in range(c["num_hidden_layers"]):
        p = lambda n: w[f"model.layers.{i}.{n}"]  # noqa: E731
        h = _rms(x, p("input_layernorm.weight"), eps)
        if c.get("q_lora_rank"):
            q = _rms(h @ p("self_attn.q_a_proj.weight").T, p("self_attn.q_a_layernorm.weight"), 1e-6)
            q = q @ p("self_attn.q_b_proj.weight").T
        else:
            q = h @ p("self_attn.q_proj.weight").T
        q = q.reshape(T, nh, dn + dr)
        kv = h @ p("self_attn.kv_a_proj_with_mqa.weight").T
        lat = _rms(kv[:, :kvr], p("self_attn.kv_a_layernorm.weight"), 1e-6)  # latent norms: fixed eps
        lat = rt(lat)
        kb = (lat @ p("self_attn.kv_b_proj.weight").T).reshape(T, nh, dn + dv)
        k_rope = rt(_rotate(kv[:, kvr:], ang, c.get("rope_interleave", True)) * att)
        q_rope = _rotate(q[..., dn:], ang, c.get("rope_interleave", True)) * att
        keys = np.concatenate([kb[..., :dn], np.broadcast_to(k_rope[:, None], (T, nh, dr))], -1)
        qs = np.concatenate([q[..., :dn], q_rope], -1)
        s = np.einsum("qhd,khd->hqk", qs, keys) * scale
        s = np.where(causal[None], s, -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", pr, kb[..., dn:]).reshape(T, nh * dv)
        x = x + o @ p("self_attn.o_proj.weight").T
        h = _rms(x, p("post_attention_layernorm.weight"), eps)
        dense = c["mlp_layer_types"][i] == "dense" if c.get("mlp_layer_types") else i < c.get("first_k_dense_replace", 0)
        if dense:
            m = (_silu(h @ p("mlp.gate_proj.weight").T) * (h @ p("mlp.up_proj.weight").T)) @ p("mlp.down_proj.weight").T
        else:
            m = np.zeros_like(h)
            logits = h @ p("mlp.gate.weight").T
            bias_name = f"model.layers.{i}.mlp.gate.e_score_correction_bias"
            for t in range(T):
                idx, wt = _route(c, logits[t], w.get(bias_name, 0.0))
                for e, we in zip(idx, wt):
                    ex = lambda n: p(f"mlp.experts.{e}.{n}_proj.weight")  # noqa: E731
                    m[t] += we * ((_silu(ex("gate") @ h[t]) * (ex("up") @ h[t])) @ ex("down").T)
            if c.get("n_shared_experts", 0):
                sh = lambda n: p(f"mlp.shared_experts.{n}_proj.weight")  # noqa: E731
                m += (_silu(h @ sh("gate").T) * (h @ sh("up").T)) @ sh("down").T
        x = x + m
    x = _rms(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if c.get("tie_word_embeddings") else w["lm_head.weight"]
    return x @ head.T
