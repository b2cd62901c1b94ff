"""The DeepSeek-V3-family decoder on CuPy arrays, for `cuda` workers: workers/model.py's
forward with the weights on the GPU and the KV cache in a DevicePool (kvstore/device_pool.py):

    embed -> layers (MLA absorbed through the pool, dense MLP or MoE) -> norm -> lm_head

Shared with the numpy model rather than copied: config and weights come from the numpy
loader (workers.weights.load_params), the q / kv_a projections and latent norms from
workers.mla.project (called with this module's rms_norm), RoPE tables from workers.rope.Rope
(cos/sin for the step's positions, computed on the host and uploaded once per step), MoE
routing from
workers.moe.route (router logits [N, E] come back to the host, so the expert choice is the
numpy model's code, as in workers/mlx_model.py), and the dense-DSA notice from Model.

Precision: weights are stored on the device as float32 (the checkpoint's bf16 values are
exact in f32; a bf16 matmul would need bf16 activations, which the numpy model does not
round to) and every matmul is a cuBLAS float32 GEMM (CuPy's default, no TF32). RMSNorm,
SiLU-gate and RoPE are fused CuPy elementwise kernels in float32. Attention runs the CUDA
kernel of kernels/cuda/attention.py (f16 operands, f32 accumulation: the documented
< 2e-3 relative error per context), so logits match the numpy model within a tolerance,
not bit for bit (tests/gpu/test_cuda_model.py states it).

Kernel launches: gate and up projections are one GEMM ([2I, H] stacked at load); routed
experts run in buckets of similar token counts, each bucket one batched GEMM per projection
(batched_gated_mlp; picks grouped on the host), and a token's routed outputs are summed in
ascending expert order, as workers.moe.expert_sum adds them (workers.moe.batched_expert_sum,
shared with a cuda worker's expert shard).

Expert parallel (`set_experts`, a `cuda` workers.ep_worker.ShardedWorker): the routed
experts the worker owns stay on the GPU, handed over to its device ExpertShard
(`take_experts`, no copy; the host keeps none), and each MoE layer gives that provider its
device activations (workers/expert_shard.py: only the rows sent to peers go to the host).

CuPy is imported lazily: this module imports on machines without it (`use_cuda` says why a
`cuda` worker runs the numpy model instead). `load_cuda(...)` is the worker's factory.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from workers.config import ModelConfig
from workers.mla import project
from workers.model import Model, check_batch, check_logits_at
from workers.moe import batched_expert_sum, route
from workers.rope import Rope
from workers.weights import load_params

log = logging.getLogger(__name__)

# gate and up projections stored stacked as one [.., 2I, H] matrix (one GEMM for both)
FUSED = {"gate_up": ("gate", "up"), "shared.gate_up": ("shared.gate", "shared.up"),
         "experts.gate_up": ("experts.gate", "experts.up")}

_ROPE = """
    const int h = d / 2, j = i % d;
    const long long r = i / d;                  // row of y viewed as [N * G, d]
    const long long n = r / G;                  // token
    const long long base = r * stride + off;    // the rope part of row r in x
    int p; long long ia, ib; bool first;
    if (inter) { p = j >> 1; first = (j & 1) == 0; ia = base + 2 * p; ib = ia + 1; }
    else { first = j < h; p = first ? j : j - h; ia = base + p; ib = ia + h; }
    const T c = cs[n * h + p], s = sn[n * h + p], a = x[ia], b = x[ib];
    y = first ? a * c - b * s : b * c + a * s;
"""


@functools.lru_cache(maxsize=None)
def _kernels() -> SimpleNamespace:
    """The fused elementwise kernels (CuPy compiles each on first use, per dtype)."""
    import cupy as cp
    return SimpleNamespace(
        sumsq=cp.ReductionKernel("T x", "T y", "x * x", "a + b", "y = a", "0", "kvf_sumsq"),
        # workers.norm.rms_norm: (x / sqrt(mean(x^2) + eps)) * w
        norm=cp.ElementwiseKernel("T x, T ss, T w, T n, T eps", "T y",
                                  "y = (x / sqrt(ss / n + eps)) * w", "kvf_rms_norm"),
        # workers.norm.silu(g) * u with silu(g) = g * 0.5 * (1 + tanh(0.5 g))
        silu_mul=cp.ElementwiseKernel("T g, T u", "T y",
                                      "y = g * ((T)0.5 * ((T)1 + tanh((T)0.5 * g))) * u",
                                      "kvf_silu_mul"),
        rope=cp.ElementwiseKernel("raw T x, raw T cs, raw T sn, int32 G, int32 d, "
                                  "int32 stride, int32 off, int32 inter", "T y", _ROPE,
                                  "kvf_rope"))


def rms_norm(x, w, eps: float):
    """x [..., D] (any strides) -> float32 RMS-normalized rows times w [D]."""
    k = _kernels()
    ss = k.sumsq(x, axis=-1, keepdims=True)
    return k.norm(x, ss, w, np.float32(x.shape[-1]), np.float32(eps))


def rope(x, cos, sin, groups: int, offset: int, dim: int, interleave: bool):
    """Rotate the rope part of x: x is a C-contiguous [N, groups * stride] array whose row
    (n, g) holds the d = `dim` rope values at [g * stride + offset, ... + dim); cos/sin
    [N, dim/2] contiguous. Returns [N, groups, dim] in workers.rope.Rope.apply's layout."""
    import cupy as cp
    if not x.flags.c_contiguous or x.ndim != 2:
        raise ValueError(f"rope input must be a C-contiguous [N, groups * stride] array, got "
                         f"shape {x.shape}, strides {x.strides}")
    n = x.shape[0]
    stride = x.shape[1] // groups
    y = cp.empty((n, groups, dim), cp.float32)
    _kernels().rope(x, cos, sin, np.int32(groups), np.int32(dim), np.int32(stride),
                    np.int32(offset), np.int32(interleave), y)
    return y


def gated_mlp(x, gate_up, down):
    """down(silu(gate x) * up x) with gate_up [2I, H] = [gate; up], down [H, I]."""
    t = x @ gate_up.T
    inter = down.shape[-1]
    return _kernels().silu_mul(t[:, :inter], t[:, inter:]) @ down.T


def batched_gated_mlp(rows: np.ndarray, xs, gate_up, down):
    """gated_mlp of G experts at once: rows [G] (host) of the stacks gate_up [n, 2I, H] and
    down [n, H, I], xs [G, C, H] C-contiguous -> [G, C, H]: cuBLAS's batched float32 GEMM
    (cublasSgemmBatched, whose pointer arrays name each expert's matrices where they lie: no
    copy of the weights) for each projection, the fused SiLU-gate kernel between them. Used
    by workers.moe.batched_expert_sum for the routed experts of CudaLayer and of a cuda
    worker's ExpertShard."""
    import cupy as cp
    from cupy_backends.cuda.libs import cublas
    G, C, H = xs.shape
    inter = down.shape[-1]
    if not (xs.flags.c_contiguous and gate_up.flags.c_contiguous and down.flags.c_contiguous):
        raise ValueError("batched_gated_mlp needs C-contiguous xs, gate_up and down")
    if gate_up.dtype != cp.float32 or down.dtype != cp.float32 or xs.dtype != cp.float32:
        raise ValueError(f"batched_gated_mlp is float32: got xs {xs.dtype}, gate_up "
                         f"{gate_up.dtype}, down {down.dtype}")
    t = cp.empty((G, C, 2 * inter), cp.float32)
    y = cp.empty((G, C, H), cp.float32)
    rows = np.asarray(rows, np.int64)
    g = np.arange(G, dtype=np.int64)
    f4 = xs.itemsize
    ptrs = np.concatenate([
        gate_up.data.ptr + rows * gate_up[0].nbytes, xs.data.ptr + g * (C * H * f4),
        t.data.ptr + g * (C * 2 * inter * f4)]).astype(np.uint64)
    dev = cp.asarray(ptrs)
    handle = cp.cuda.device.get_cublas_handle()
    one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
    T, N = cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N

    def gemm(a, b, c, m, n, kk, lda):
        # row-major C [n, m] = B [n, kk] . A^T with A [m, kk]: column-major C^T = op(A^T) B^T
        cublas.sgemmBatched(handle, T, N, m, n, kk, one.ctypes.data, a, lda, b, kk,
                            zero.ctypes.data, c, m, G)

    step = 8 * G
    gemm(dev.data.ptr, dev.data.ptr + step, dev.data.ptr + 2 * step, 2 * inter, C, H, H)
    u = _kernels().silu_mul(t[..., :inter], t[..., inter:])  # [G, C, I], C-contiguous
    ptrs2 = np.concatenate([down.data.ptr + rows * down[0].nbytes, u.data.ptr + g * (C * inter * f4),
                            y.data.ptr + g * (C * H * f4)]).astype(np.uint64)
    dev2 = cp.asarray(ptrs2)
    gemm(dev2.data.ptr, dev2.data.ptr + step, dev2.data.ptr + 2 * step, H, C, inter, inter)
    # (the pointer arrays stay referenced until the GEMMs have read them: the stream's order
    # frees them only for later work)
    return y


def device_params(p: dict[str, np.ndarray]) -> dict:
    """One layer's host parameters -> device arrays: gate/up pairs stacked (FUSED), kv_b
    split into W_UK [H, Dn, Dl] and W_UV^T [H, Dl, Dv] by the caller, router bias left out
    (routing runs on the host)."""
    import cupy as cp
    d = {new: cp.asarray(np.concatenate([p[g], p[u]], axis=-2))
         for new, (g, u) in FUSED.items() if g in p}
    skip = {name for pair in FUSED.values() for name in pair} | {"kv_b", "router_bias"}
    d.update({k: cp.asarray(v) for k, v in p.items() if k not in skip})
    return d


class CudaLayer:
    def __init__(self, cfg: ModelConfig, i: int, p: dict[str, np.ndarray], rope_: Rope):
        import cupy as cp
        self.cfg, self.i, self.rope = cfg, i, rope_
        self.d = device_params(p)
        nh, dn, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        kv_b = p["kv_b"].reshape(nh, dn + dv, cfg.kv_lora_rank)
        self.w_uk = cp.asarray(np.ascontiguousarray(kv_b[:, :dn]))  # [H, Dn, Dl]
        self.w_uv_t = cp.asarray(np.ascontiguousarray(kv_b[:, dn:].transpose(0, 2, 1)))  # [H, Dl, Dv]
        self.router_bias = p.get("router_bias")  # host: workers.moe.route
        self.experts = None  # routed-expert provider (workers.moe.MoE); None = all on device

    def take_experts(self):
        """(gate_up [n, 2I, H], down [n, H, I]) device stacks of the routed experts loaded,
        removed from this layer (an expert-parallel worker's shard takes them over), or None
        where none were loaded."""
        gate_up, down = self.d.pop("experts.gate_up", None), self.d.pop("experts.down", None)
        return None if gate_up is None else (gate_up, down)

    def set_experts(self, experts) -> None:
        """Routed experts come from `experts` (device arrays in and out): drop any device
        copies left."""
        self.experts = experts
        self.take_experts()

    def attention(self, x, slots, positions, pool, cos, sin):
        import cupy as cp
        c, d, N = self.cfg, self.d, x.shape[0]
        H, dn, dr = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim
        q, L, k_rope = project(x, d, c, rms_norm)  # q [N, H, qk] C-contiguous, k_rope a view
        inter = self.rope.interleave
        R = rope(cp.ascontiguousarray(k_rope), cos, sin, 1, 0, dr, inter).reshape(N, dr)
        q_rope = rope(q.reshape(N, -1), cos, sin, H, dn, dr, inter)  # [N, H, Dr]
        q_nope = q[:, :, :dn].transpose(1, 0, 2)  # [H, N, Dn]
        q_lat = cp.ascontiguousarray(cp.matmul(q_nope, self.w_uk).transpose(1, 0, 2))  # [N, H, Dl]
        pool.write(self.i, slots, positions, L, R)
        ctx = pool.attend(self.i, slots, positions, q_lat, q_rope, self.rope.softmax_scale)
        out = cp.matmul(ctx.transpose(1, 0, 2), self.w_uv_t)  # [H, N, Dv]
        out = out.transpose(1, 0, 2).reshape(N, -1) @ d["o"].T
        if "o_bias" in d:
            out += d["o_bias"]
        return out

    def moe(self, y):
        d = self.d
        idx, w = route(self.cfg, (y @ d["router"].T).get(), self.router_bias)  # host [N, k]
        if self.experts is not None:  # expert parallel: device rows in and out
            out = self.experts.apply(self.i, y, idx, w)
        else:
            out = self._routed(y, idx, w)
        if "shared.gate_up" in d:
            out += gated_mlp(y, d["shared.gate_up"], d["shared.down"])
        return out

    def _routed(self, y, idx: np.ndarray, w: np.ndarray):
        """sum_k w[n, k] * expert_{idx[n, k]}(y[n]) (idx, w: host [N, k]) through
        workers.moe.batched_expert_sum, the code of an expert-parallel worker's device shard."""
        import cupy as cp
        gu, down = self.d["experts.gate_up"], self.d["experts.down"]
        return batched_expert_sum(y, idx, w, lambda e, xs: batched_gated_mlp(e, xs, gu, down), cp)

    def __call__(self, x, slots, positions, pool, cos, sin):
        eps, d = self.cfg.rms_norm_eps, self.d
        h = x + self.attention(rms_norm(x, d["attn_norm"], eps), slots, positions, pool, cos, sin)
        y = rms_norm(h, d["mlp_norm"], eps)
        if self.cfg.is_moe_layer(self.i):
            return h + self.moe(y)
        return h + gated_mlp(y, d["gate_up"], d["down"])


class CudaModel:
    """Same interface as workers.model.Model: `config`, `forward(...) -> numpy logits`."""

    def __init__(self, cfg: ModelConfig, params: dict[str, np.ndarray]):
        import cupy as cp
        self.config = cfg
        self.rope = Rope.from_config(cfg)
        self.dense_past_topk = False  # read by Model._note_dense_dsa
        self.embed = cp.asarray(params["embed"])
        self.norm = cp.asarray(params["norm"])
        self.lm_head = self.embed if cfg.tie_word_embeddings else cp.asarray(params["lm_head"])
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            pre = f"layers.{i}."
            p = {k[len(pre):]: v for k, v in params.items() if k.startswith(pre)}
            self.layers.append(CudaLayer(cfg, i, p, self.rope))
        self.pool = None  # set by load_cuda: its fallback counters are reported per step
        self._fallbacks_seen: dict = {}

    @classmethod
    def load(cls, model_dir: str | Path, experts: dict[int, np.ndarray] | None = None) -> "CudaModel":
        """experts: load only these routed experts per layer (workers.weights.load_params)."""
        cfg = ModelConfig.from_file(Path(model_dir) / "config.json")
        model = cls(cfg, load_params(model_dir, cfg, experts=experts))
        log.info("loaded %s on CUDA: %d layers, vocab %d", model_dir, cfg.num_hidden_layers,
                 cfg.vocab_size)
        return model

    def set_experts(self, experts) -> None:
        """Route every MoE layer's experts through `experts` (see workers.moe.MoE), which
        must take and return device arrays: workers.expert_shard.ShardedExperts over a
        cupy ExpertShard (device "cuda")."""
        if getattr(experts, "device", None) != "cuda":
            raise TypeError(f"a CudaModel's expert provider must work on device arrays "
                            f"(device 'cuda'), got {experts!r} on {getattr(experts, 'device', None)!r}")
        for layer in self.layers:
            if self.config.is_moe_layer(layer.i):
                layer.set_experts(experts)

    def take_experts(self, i: int):
        """Layer i's routed expert device stacks, handed over (CudaLayer.take_experts)."""
        return self.layers[i].take_experts()

    def forward(self, tokens, slots, positions, pool, logits_at=None) -> np.ndarray:
        """Logits [N, vocab] (or [len(logits_at), vocab]) float32 on the host."""
        import cupy as cp
        tokens, slots, positions = check_batch(tokens, slots, positions, self.config.vocab_size)
        logits_at = check_logits_at(logits_at, len(tokens))
        Model._note_dense_dsa(self, positions)  # the numpy model's DSA notice, same state
        cos, sin = (cp.asarray(a) for a in self.rope.cos_sin(positions))
        x = cp.take(self.embed, cp.asarray(tokens), axis=0)
        for layer in self.layers:
            x = layer(x, slots, positions, pool, cos, sin)
        if logits_at is not None:
            x = cp.take(x, cp.asarray(logits_at), axis=0)
        x = rms_norm(x, self.norm, self.config.rms_norm_eps)
        return (x @ self.lm_head.T).get()

    def drain_fallbacks(self) -> dict[str, int]:
        """Fallbacks since the last call, for the worker step: the pool's CPU paths
        (cuda.<op>_<tier>, e.g. polar tiers) and the attention module's slower launches
        (cuda.<name>, e.g. a smaller tile where shared memory is short); workers/fallbacks.py
        lists every path."""
        from kernels.cuda import attention as cuda_attention
        out = {f"cuda.{name}": n for name, n in cuda_attention.drain_fallbacks().items()}
        if self.pool is None:
            return out
        now = dict(self.pool.counters.fallbacks)
        out.update({f"cuda.{op}_{tier}": n - self._fallbacks_seen.get((op, tier), 0)
                    for (op, tier), n in now.items() if n > self._fallbacks_seen.get((op, tier), 0)})
        self._fallbacks_seen = now
        return out


def use_cuda(worker: str) -> bool:
    """True when CuPy sees a CUDA device; else says (WARNING) that `worker` of kind cuda
    runs the numpy model on the host."""
    if importlib.util.find_spec("cupy") is None:
        why = "cupy is not installed"
    else:
        from kernels.cuda._build import cuda_available
        why = None if cuda_available() else "CuPy sees no CUDA device"
    if why:
        log.warning("%s: kind cuda but %s: running the numpy model on the host", worker, why)
    return why is None


def load_cuda(model_dir: str | Path, tier: str, slots: int, max_ctx: int, block_size: int = 16,
              experts: dict[int, np.ndarray] | None = None):
    """(CudaModel, DevicePool) of a `cuda` worker: weights and KV cache on the current device."""
    from kvstore.device_pool import DevicePool
    model = CudaModel.load(model_dir, experts=experts)
    pool = DevicePool.for_model(model.config, tier, slots, max_ctx, block_size=block_size)
    model.pool = pool
    return model, pool
