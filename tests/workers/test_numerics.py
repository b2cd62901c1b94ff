"""Scalar numerics the whole model leans on: the router sigmoid against float64, and the YaRN
attention factor against transformers' `_compute_yarn_parameters` formula."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from workers.config import ModelConfig
from workers.moe import route
from workers.norm import sigmoid, silu
from workers.rope import Rope


def _exact_sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x.astype(np.float64)))


def test_sigmoid_is_within_one_float32_ulp_everywhere():
    rng = np.random.default_rng(0)
    x = np.concatenate([np.linspace(-100, 100, 400_001, dtype=np.float32),
                        rng.uniform(-100, 100, 100_000).astype(np.float32),
                        np.float32([0.0, -0.0, 1e-30, -1e-30, -87.5, -88.7, -89.5])])
    with np.errstate(over="raise", divide="raise", invalid="raise"):  # no overflow warnings either
        got = sigmoid(x)
        assert got.dtype == np.float32
        ref = _exact_sigmoid(x)
        ulps = np.abs(got - ref) / np.spacing(ref.astype(np.float32)).astype(np.float64)
    assert ulps.max() <= 1.0, f"max {ulps.max():.2f} ulps at x={x[ulps.argmax()]}"
    assert sigmoid(np.float32([-1e30, -np.inf, 1e30, np.inf])).tolist() == [0.0, 0.0, 1.0, 1.0]
    assert np.isnan(sigmoid(np.float32([np.nan]))).all()
    # silu keeps the tanh form of the CUDA / MLX kernels: within 2e-6 of x * sigmoid(x)
    s = np.linspace(-30, 30, 6001, dtype=np.float32)
    np.testing.assert_allclose(silu(s), s * _exact_sigmoid(s), rtol=1e-5, atol=2e-6)


def test_router_keeps_weights_of_very_negative_logits(tiny):
    """noaux_tc weights come from sigmoid(logits): tiny scores must keep their ratio, not round to 0."""
    cfg = ModelConfig.from_file(tiny())
    E = cfg.n_routed_experts
    logits = np.linspace(-24.0, -17.0, E, dtype=np.float32)[None, :]
    idx, w = route(cfg, logits, np.zeros(E, np.float32))
    s = _exact_sigmoid(logits)[0, idx[0]]
    want = s / (s.sum() + 1e-20) * cfg.routed_scaling_factor
    np.testing.assert_allclose(w[0], want, rtol=1e-6, atol=0)


def _hf_attention_factor(rs: dict) -> float:
    """transformers' `_compute_yarn_parameters`: mscale / mscale_all_dim are read with .get()."""
    def get_mscale(scale, mscale=1):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
    f, af = rs["factor"], rs.get("attention_factor")
    if af is not None:
        return af
    mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(get_mscale(f, mscale) / get_mscale(f, mscale_all_dim))
    return get_mscale(f)


@pytest.mark.parametrize("extra", [
    {"mscale_all_dim": 1.0},  # no mscale key: transformers falls back to mscale(factor)
    {"mscale": None, "mscale_all_dim": 1.0},
    {"mscale": 1.0, "mscale_all_dim": 1.0},
    {"mscale": 0.707, "mscale_all_dim": 0.707},
    {"mscale": 1.0, "mscale_all_dim": 0.7},
    {"mscale": 0.0, "mscale_all_dim": 1.0},
    {"mscale": 1.0},
    {},
    {"mscale_all_dim": 1.0, "attention_factor": 1.25},
])
@pytest.mark.parametrize("form", ["rope_scaling", "rope_parameters"])
def test_yarn_attention_factor_matches_transformers(tiny, extra, form):
    raw = json.loads((tiny() / "config.json").read_text())
    rs = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
          "beta_slow": 1, **extra}
    raw["max_position_embeddings"] = 163840
    if form == "rope_parameters":
        raw.pop("rope_scaling")
        raw["rope_parameters"] = {"rope_theta": raw.pop("rope_theta"), **rs}
    else:
        raw["rope_scaling"] = rs
    r = Rope.from_config(ModelConfig.from_dict(raw))
    assert r.attention_factor == pytest.approx(_hf_attention_factor(rs), rel=1e-12)
    m = 0.1 * (rs.get("mscale_all_dim") or 0) * math.log(40) + 1.0  # softmax scale: mscale_all_dim only
    assert r.softmax_scale == pytest.approx((16 + 64) ** -0.5 * m * m, rel=1e-12)


def test_noaux_tc_group_mask_is_transformers_zero_fill(tiny):
    """With a negative correction bias the kept group's choices are negative: transformers'
    get_topk_indices sets the dropped groups' choices to 0.0 (masked_fill), so experts of a
    dropped group can be picked; route() used -inf and never picked them."""
    raw = json.loads((tiny() / "config.json").read_text())
    raw.update(n_group=2, topk_group=1, num_experts_per_tok=4, topk_method="noaux_tc",
               scoring_func="sigmoid")
    cfg = ModelConfig.from_dict(raw)
    E, G, k = cfg.n_routed_experts, 2, 4
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((16, E)).astype(np.float32)
    bias = np.full(E, -0.6, np.float32)
    choice = _exact_sigmoid(logits).astype(np.float32) + bias
    top2 = np.sort(choice.reshape(-1, G, E // G), -1)[..., -2:].sum(-1)
    keep = np.argsort(-top2, -1, kind="stable")[:, :1]
    mask = np.zeros_like(top2, bool)
    np.put_along_axis(mask, keep, True, -1)
    masked = np.where(np.repeat(mask, E // G, axis=1), choice, 0.0)
    want = np.sort(np.argsort(-masked, -1, kind="stable")[:, :k], -1)
    idx, _ = route(cfg, logits, bias)
    assert np.array_equal(np.sort(idx, -1), want)
    dropped = ~np.take_along_axis(np.repeat(mask, E // G, axis=1), idx, -1)
    assert dropped.any()  # the case the fill value decides


@pytest.mark.parametrize("method", [dict(topk_method="noaux_tc", scoring_func="sigmoid", n_group=2, topk_group=1),
                                    dict(topk_method="noaux_tc", scoring_func="sigmoid", n_group=1, topk_group=1),
                                    dict(topk_method="group_limited_greedy", scoring_func="softmax", n_group=2,
                                         topk_group=1),
                                    dict(topk_method="greedy", scoring_func="softmax", n_group=1, topk_group=1)],
                         ids=lambda m: f"{m['topk_method']}-G{m['n_group']}")
def test_router_nan_logit_is_picked_as_torch_topk_picks_it(tiny, method):
    """torch.topk ranks NaN above every number, so transformers' sigmoid router picks an expert
    whose logit is NaN and the token's weights are NaN; route() sorted NaN last and silently
    routed the token elsewhere with finite weights (its group dropped too under n_group > 1)."""
    raw = json.loads((tiny() / "config.json").read_text())
    cfg = ModelConfig.from_dict({**raw, **method})
    E = cfg.n_routed_experts
    logits = np.tile(np.linspace(-1, 1, E, dtype=np.float32), (3, 1))
    logits[1] = logits[1, ::-1]
    logits[0, 5] = np.nan
    idx, w = route(cfg, logits, np.zeros(E, np.float32))
    assert np.isnan(w[0]).all()
    if cfg.scoring_func == "sigmoid":  # softmax makes the whole row NaN: any pick is right
        assert idx[0, 0] == 5
    clean_idx, clean_w = route(cfg, logits[1:], np.zeros(E, np.float32))  # other tokens unchanged
    assert np.array_equal(idx[1:], clean_idx) and np.array_equal(w[1:], clean_w)
    assert np.isfinite(w[1:]).all()
