"""Multi-head latent attention (MLA), absorbed form, reading through the KV pool.

Per token: q = W_q x (through the q LoRA when q_lora_rank is set), split per head into
q_nope [Dn] and q_rope [Dr]; kv_a = W_kva x splits into the latent (then kv_a_layernorm)
L [Dl] and the shared rope key R [Dr]. The pool stores L and R (RoPE applied).

kv_b_proj [H*(Dn+Dv), Dl] holds per head W_UK [Dn, Dl] then W_UV [Dv, Dl]. Absorbing them:
    q_lat = q_nope . W_UK                       # [N, H, Dl]
    ctx   = softmax((q_lat.L_t + q_rope.R_t) * scale) . L   (pool.attend)
    out   = o_proj(ctx . W_UV^T)                # [N, H, Dv] -> [N, hidden]
which equals materializing per-head keys [k_nope = W_UK L_t, R_t] and values W_UV L_t.

q_a_layernorm and kv_a_layernorm use eps 1e-6 whatever rms_norm_eps says: transformers
(DeepseekV3, GlmMoeDsa) and DeepSeek's reference build them with the default eps; only the
per-layer and final norms read rms_norm_eps (GLM-5 sets it to 1e-5).
"""
from __future__ import annotations

import numpy as np

from workers.config import ModelConfig
from workers.norm import rms_norm
from workers.rope import Rope

LATENT_NORM_EPS = 1e-6


def project(x, p: dict, cfg: ModelConfig, norm):
    """The input projections on numpy or MLX arrays (`norm` is that library's rms_norm):
    x [N, hidden] -> (q [N, H, qk_head_dim], L [N, Dl] after kv_a_layernorm, the rope key
    [N, Dr] before RoPE)."""
    if cfg.q_lora_rank is None:
        q = x @ p["q"].T
    else:
        qa = x @ p["q_a"].T
        if "q_a_bias" in p:
            qa = qa + p["q_a_bias"]
        q = norm(qa, p["q_a_norm"], LATENT_NORM_EPS) @ p["q_b"].T
    kv = x @ p["kv_a"].T
    if "kv_a_bias" in p:
        kv = kv + p["kv_a_bias"]
    L = norm(kv[:, :cfg.kv_lora_rank], p["kv_a_norm"], LATENT_NORM_EPS)
    return q.reshape(x.shape[0], cfg.num_attention_heads, cfg.qk_head_dim), L, kv[:, cfg.kv_lora_rank:]


class MLA:
    def __init__(self, cfg: ModelConfig, p: dict[str, np.ndarray], rope: Rope):
        self.cfg, self.p, self.rope = cfg, p, rope
        nh, dn, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        kv_b = p["kv_b"].reshape(nh, dn + dv, cfg.kv_lora_rank)
        self.w_uk = np.ascontiguousarray(kv_b[:, :dn])  # [H, Dn, Dl]
        self.w_uv = np.ascontiguousarray(kv_b[:, dn:])  # [H, Dv, Dl]

    def project(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray):
        """x [N, hidden] -> (q_nope [N,H,Dn], q_rope [N,H,Dr] rotated, L [N,Dl], R [N,Dr] rotated)."""
        dn = self.cfg.qk_nope_head_dim
        q, L, k_rope = project(x, self.p, self.cfg, rms_norm)
        R = self.rope.apply(k_rope, cos, sin)
        return q[..., :dn], self.rope.apply(q[..., dn:], cos, sin), L, R

    def __call__(self, x: np.ndarray, layer: int, slots: np.ndarray, positions: np.ndarray,
                 pool, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        q_nope, q_rope, L, R = self.project(x, cos, sin)
        q_lat = np.matmul(q_nope.transpose(1, 0, 2), self.w_uk).transpose(1, 0, 2)  # [N, H, Dl]
        pool.write(layer, slots, positions, L, R)
        ctx = pool.attend(layer, slots, positions, np.ascontiguousarray(q_lat),
                          np.ascontiguousarray(q_rope), self.rope.softmax_scale)  # [N, H, Dl]
        out = np.matmul(ctx.transpose(1, 0, 2), self.w_uv.transpose(0, 2, 1))  # [H, N, Dv]
        out = out.transpose(1, 0, 2).reshape(len(x), -1) @ self.p["o"].T
        if "o_bias" in self.p:
            out = out + self.p["o_bias"]
        return out.astype(np.float32, copy=False)
