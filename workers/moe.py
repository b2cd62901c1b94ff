"""Mixture of experts: the router (top-k over sigmoid or softmax scores) and the SiLU-gated
experts, routed plus shared. Dense layers (first_k_dense_replace) use `gated_mlp` alone.

Routers, as transformers implements them:
  noaux_tc (sigmoid)  s = sigmoid(logits); choice = s + e_score_correction_bias; with n_group
      > 1 a group scores the sum of its top-2 choices and only the best topk_group groups stay
      (the others' choices set to 0.0, transformers' masked_fill: where a negative bias makes
      kept choices negative, experts of dropped groups can win); top-k over choice picks
      experts; weights come from s (unbiased).
  greedy (softmax)    s = softmax(logits); top-k of s.
  group_limited_greedy  as greedy after keeping the topk_group groups with the largest max s.
Then weights /= sum + 1e-20 when norm_topk_prob, and *= routed_scaling_factor.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from workers.config import ModelConfig
from workers.norm import sigmoid, silu


def gated_mlp(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """down(silu(gate x) * up x); x [N, hidden], gate/up [I, hidden], down [hidden, I]."""
    return (silu(x @ gate.T) * (x @ up.T)) @ down.T


def _top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices [N, k] of the k largest per row (ties: lower index first). NaN ranks above
    every number, as in torch.topk (transformers' routers): a NaN score is picked and its NaN
    reaches the output, where sorting it last would drop that expert or group unseen."""
    return np.lexsort((-scores, ~np.isnan(scores)), axis=-1)[:, :k]


def _keep_groups(choice: np.ndarray, group_score: np.ndarray, keep: int, fill: float) -> np.ndarray:
    """Set the experts of all but the `keep` best groups to `fill`. choice [N, E], group_score [N, G]."""
    n, g = group_score.shape
    best = _top_k(group_score, keep)
    mask = np.zeros((n, g), bool)
    np.put_along_axis(mask, best, True, axis=-1)
    mask = np.repeat(mask, choice.shape[1] // g, axis=1)
    return np.where(mask, choice, np.float32(fill))


def route(cfg: ModelConfig, logits: np.ndarray, bias: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Router logits [N, E] -> (expert ids [N, k], weights [N, k] f32)."""
    k, G = cfg.num_experts_per_tok, cfg.n_group
    if cfg.scoring_func == "sigmoid":
        scores = sigmoid(logits)
    else:
        z = logits - logits.max(axis=-1, keepdims=True)
        e = np.exp(z)
        scores = e / e.sum(axis=-1, keepdims=True)
    choice = scores + bias if (cfg.topk_method == "noaux_tc" and bias is not None) else scores
    if cfg.topk_method == "noaux_tc" and G > 1:
        grouped = np.sort(choice.reshape(len(choice), G, -1), axis=-1)
        choice = _keep_groups(choice, grouped[..., -2:].sum(-1), cfg.topk_group, 0.0)
    elif cfg.topk_method == "group_limited_greedy" and G > 1:
        choice = _keep_groups(choice, choice.reshape(len(choice), G, -1).max(-1), cfg.topk_group, 0.0)
    idx = _top_k(choice, k)
    w = np.take_along_axis(scores, idx, axis=-1)
    if cfg.norm_topk_prob:
        w = w / (w.sum(axis=-1, keepdims=True) + np.float32(1e-20))
    return idx, (w * np.float32(cfg.routed_scaling_factor)).astype(np.float32)


def expert_sum(x: np.ndarray, idx: np.ndarray, w: np.ndarray, gate: np.ndarray, up: np.ndarray,
               down: np.ndarray) -> np.ndarray:
    """sum_k w[n, k] * expert_{idx[n, k]}(x[n]) -> [N, hidden]; idx [N, k] are rows of the
    stacked gate/up [E, I, hidden] and down [E, hidden, I]; picks with idx < 0 are skipped."""
    out = np.zeros_like(x)
    wf = w.reshape(-1)
    for e, pick in picks_by_expert(idx):  # one matmul per expert that has tokens
        tok = pick // idx.shape[1]  # each token picks an expert at most once: no repeated rows
        out[tok] += gated_mlp(x[tok], gate[e], up[e], down[e]) * wf[pick, None]
    return out


def grouped_expert_sum(x, idx: np.ndarray, w: np.ndarray, mlp: Callable, xp: Any = np):
    """expert_sum's sum, written once for numpy and CuPy: x [N, hidden] and the result are
    arrays of module `xp` (numpy, or cupy on a GPU), idx / w host [N, k] (w float32), and
    `mlp(e, rows [n, hidden]) -> [n, hidden]` is expert e's gated MLP in that module.

    The picks are grouped by expert, ascending (picks_by_expert; idx < 0 skipped): one mlp
    call per expert that has tokens, on a contiguous block of the gathered rows, times the
    picks' weights. Then each token's weighted outputs are added onto zeros in ascending
    expert order, as expert_sum adds them (a token with fewer picks adds a zero row in their
    place: s + 0 is s, and s is never -0 on a sum that starts at +0). So with numpy and
    `gated_mlp` this gives expert_sum's result bit for bit (tests/workers/test_expert_shard.py)."""
    N, k = idx.shape
    groups = picks_by_expert(idx)
    out = xp.zeros_like(x)
    if not groups:
        return out
    order = np.concatenate([pick for _, pick in groups])  # flat picks, grouped by expert
    tok = order // k  # each token picks an expert at most once: no token twice in a group
    depth, back = _sum_table(tok, N, np.arange(len(order)), len(order))
    wts = xp.asarray(np.asarray(w, np.float32).reshape(-1)[order][:, None])
    xs = xp.take(x, xp.asarray(tok), axis=0)  # [P, hidden], grouped by expert
    ys = xp.empty((len(order) + 1, x.shape[1]), x.dtype)  # weighted outputs, then a zero row
    ys[-1] = 0
    a = 0
    for e, pick in groups:
        b = a + len(pick)
        xp.multiply(mlp(e, xs[a:b]), wts[a:b], out=ys[a:b])
        a = b
    z = xp.take(ys, xp.asarray(back), axis=0).reshape(N, depth, -1)
    for j in range(depth):
        out += z[:, j]
    return out


def _sum_table(tok: np.ndarray, N: int, rows: np.ndarray, zero: int) -> tuple[int, np.ndarray]:
    """(depth, back [N * depth]) for adding each token's outputs in the order of its picks:
    tok [P] the token of each pick (picks in ascending expert order), rows [P] the output row
    of each; back[n * depth + j] is the row of token n's j-th pick, `zero` (a row of zeros)
    where it has fewer than depth."""
    count = np.bincount(tok, minlength=N)
    by_tok = np.argsort(tok, kind="stable")  # a token's picks, still in ascending expert order
    place = np.empty(len(tok), np.int64)  # a pick's place in its token's sum
    place[by_tok] = np.arange(len(tok)) - (np.cumsum(count) - count)[tok[by_tok]]
    depth = int(count.max())
    back = np.full(N * depth, zero, np.int64)
    back[tok * depth + place] = rows
    return depth, back


def batched_expert_sum(x, idx: np.ndarray, w: np.ndarray, batched_mlp: Callable, xp: Any = np):
    """grouped_expert_sum's sum with the experts' MLPs run a bucket at a time instead of one
    expert at a time: `batched_mlp(rows [G] (host: the experts' stack rows, ascending),
    xs [G, C, hidden]) -> [G, C, hidden]` runs G experts at once on C rows each (CuPy: a
    batched GEMM per projection, workers.cuda_model.batched_gated_mlp). An expert's tokens
    fill its C rows, padded with a zero row; experts are bucketed by their token count's next
    power of two, so the padding is less than half of a bucket's rows and there are at most
    log2(N) + 1 buckets. The weighted outputs are then added per token in ascending expert
    order, exactly as grouped_expert_sum adds them: only the expert MLPs' own rounding (a
    batched GEMM against one GEMM per expert) can differ. On the GPU this is a few launches
    per bucket where the expert loop made four per expert (launch-bound at decode sizes:
    scripts/bench_split_shard.py)."""
    N, k = idx.shape
    groups = picks_by_expert(idx)
    out = xp.zeros_like(x)
    if not groups:
        return out
    counts = np.array([len(pick) for _, pick in groups])
    key = np.left_shift(1, np.ceil(np.log2(counts)).astype(np.int64))  # next power of two
    buckets = [np.flatnonzero(key == b) for b in np.unique(key)]
    # host tables: per bucket [G, C] token (N: the zero row) and flat pick (-1: padding);
    # the padded output rows of all buckets follow each other, the zero row last
    toks, picks, offs, total = [], [], [], 0
    for gs in buckets:
        C = int(counts[gs].max())
        pk = np.full((len(gs), C), -1, np.int64)
        for r, g in enumerate(gs):
            pk[r, :counts[g]] = groups[g][1]
        toks.append(np.where(pk >= 0, pk // k, N))
        picks.append(pk)
        offs.append(total)
        total += pk.size
    pick_row = np.empty(N * k, np.int64)  # flat pick -> its padded output row
    for pk, off in zip(picks, offs):
        live = pk.reshape(-1) >= 0
        pick_row[pk.reshape(-1)[live]] = off + np.flatnonzero(live)
    order = np.concatenate([pick for _, pick in groups])  # flat picks, ascending expert
    depth, back = _sum_table(order // k, N, pick_row[order], total)
    wf = np.append(np.asarray(w, np.float32).reshape(-1), np.float32(0))
    wts = np.concatenate([wf[pk.reshape(-1)] for pk in picks])  # (padding: -1 -> the 0 appended)
    # one upload of the integer tables and one of the weights
    ints = xp.asarray(np.concatenate([t.reshape(-1) for t in toks] + [back]))
    wts = xp.asarray(wts[:, None])
    xz = xp.concatenate([x, xp.zeros((1, x.shape[1]), x.dtype)])
    ys = xp.empty((total + 1, x.shape[1]), x.dtype)
    ys[-1] = 0
    a = 0
    for gs, t, off in zip(buckets, toks, offs):
        G, C = t.shape
        xs = xp.take(xz, ints[a:a + G * C], axis=0).reshape(G, C, -1)
        xp.multiply(batched_mlp(np.array([groups[g][0] for g in gs]), xs).reshape(G * C, -1),
                    wts[off:off + G * C], out=ys[off:off + G * C])
        a += G * C
    z = xp.take(ys, ints[a:], axis=0).reshape(N, depth, -1)
    for j in range(depth):
        out += z[:, j]
    return out


def picks_by_expert(idx: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """The picks of idx [N, k] grouped by expert, ascending: [(expert, flat pick indices
    into idx.reshape(-1), ascending)]; pick // k is the token. Picks with idx < 0 are skipped."""
    flat = idx.reshape(-1)
    order = np.argsort(flat, kind="stable")
    order = order[flat[order] >= 0]
    experts, starts = np.unique(flat[order], return_index=True)
    ends = np.append(starts[1:], len(order))
    return [(e, order[a:b]) for e, a, b in zip(experts.tolist(), starts.tolist(), ends.tolist())]


class MoE:
    """`experts` is the one injection point for expert parallelism: an object with
    `apply(layer, x [N, hidden], idx [N, k] expert ids, w [N, k]) -> [N, hidden]` that returns
    the weighted sum of the routed experts (workers/expert_shard.py computes its own shard
    and sends the rest away). None = every routed expert is in `p` and computed here."""

    def __init__(self, cfg: ModelConfig, p: dict[str, np.ndarray], layer: int = -1, experts=None):
        self.cfg, self.p, self.layer, self.experts = cfg, p, layer, experts

    def __call__(self, x: np.ndarray) -> np.ndarray:
        p = self.p
        idx, w = route(self.cfg, x @ p["router"].T, p.get("router_bias"))
        if self.experts is not None:
            out = self.experts.apply(self.layer, x, idx, w)
        else:
            out = expert_sum(x, idx, w, p["experts.gate"], p["experts.up"], p["experts.down"])
        if "shared.gate" in p:
            out += gated_mlp(x, p["shared.gate"], p["shared.up"], p["shared.down"])
        return out
