"""The MLX model against the numpy model on the tiny checkpoint: greedy output over 64
tokens for f32 and kv8, logits through prefill and a ragged multi-slot decode, the factory."""
import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from kernels.metal.pool import MLXKVPool  # noqa: E402
from kvstore.pool import KVPool  # noqa: E402
from workers.mlx_model import MLXModel, load_metal  # noqa: E402
from workers.model import Model  # noqa: E402
from workers.weights import load_params  # noqa: E402

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from scripts.make_tiny_model import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("tiny-metal"), 0, ())


@pytest.fixture(scope="module")
def models(tiny_dir):
    ref = Model.load(tiny_dir)
    params = load_params(tiny_dir, ref.config)
    return ref, MLXModel(ref.config, params)


PROMPT = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 7, 9, 300, 17]


def greedy(model, pool_cls, tier, prompt, n_new):
    cfg = model.config
    pool = pool_cls.for_model(cfg, tier, slots=2, max_ctx=len(prompt) + n_new + 1, block_size=8)
    s = pool.alloc_slot()
    n = len(prompt)
    logits = model.forward(prompt, [s] * n, np.arange(n), pool, logits_at=[n - 1])
    out, all_logits = [], [logits[0]]
    for step in range(n_new):
        tok = int(np.argmax(logits[0]))
        out.append(tok)
        logits = model.forward([tok], [s], [n + step], pool)
        all_logits.append(logits[0])
    return out, np.stack(all_logits)


@pytest.mark.parametrize("tier", ["f32", "kv8"])
def test_greedy_64_tokens_equal_numpy(models, tier):
    ref, mlx_model = models
    want, want_logits = greedy(ref, KVPool, tier, PROMPT, 64)
    got, got_logits = greedy(mlx_model, MLXKVPool, tier, PROMPT, 64)
    assert got == want
    np.testing.assert_allclose(got_logits, want_logits, rtol=0, atol=2e-4 * np.abs(want_logits).max())


def test_tq4_logits_close_to_numpy(models):
    ref, mlx_model = models
    _, want = greedy(ref, KVPool, "tq4", PROMPT, 16)
    _, got = greedy(mlx_model, MLXKVPool, "tq4", PROMPT, 16)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())


def test_ragged_batch_matches_numpy_and_counts_fallbacks(models):
    ref, mlx_model = models
    cfg = ref.config
    rng = np.random.default_rng(4)
    pools = [KVPool.for_model(cfg, "kv8", 3, 64, block_size=8),
             MLXKVPool.for_model(cfg, "kv8", 3, 64, block_size=8)]
    lens = [11, 3, 25]
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lens]
    outs = []
    for model, pool in zip((ref, mlx_model), pools):
        slots = [pool.alloc_slot() for _ in lens]
        for s, pr in zip(slots, prompts):  # prefill each slot
            model.forward(pr, [s] * len(pr), np.arange(len(pr)), pool)
        toks = [pr[-1] for pr in prompts]  # one ragged decode step: three slots, three lengths
        outs.append(model.forward(toks, slots, lens, pool))
    np.testing.assert_allclose(outs[1], outs[0], rtol=0, atol=2e-4 * np.abs(outs[0]).max())
    assert mlx_model.drain_fallbacks() == {} and pools[1].stats.fallback_count() > 0


def test_latent_norms_ignore_rms_norm_eps(tiny_dir, tmp_path):
    """q_a/kv_a norms use eps 1e-6 whatever rms_norm_eps says (workers/mla.py); a large
    rms_norm_eps (GLM-5 sets 1e-5) must move both models' logits the same way."""
    import json
    import shutil
    d = tmp_path / "tiny-eps"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rms_norm_eps"] = 0.05
    (d / "config.json").write_text(json.dumps(cfg))
    ref = Model.load(d)
    mlx_model = MLXModel(ref.config, load_params(d, ref.config))
    _, want = greedy(ref, KVPool, "f32", PROMPT, 4)
    _, got = greedy(mlx_model, MLXKVPool, "f32", PROMPT, 4)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())


def test_bad_inputs_name_the_values(models):
    _, mlx_model = models
    pool = MLXKVPool.for_model(mlx_model.config, "f32", slots=1, max_ctx=8, block_size=8)
    s = pool.alloc_slot()
    V = mlx_model.config.vocab_size
    with pytest.raises(ValueError, match=rf"ids \[{V}\] are outside the vocabulary"):
        mlx_model.forward([1, V], [s, s], [0, 1], pool)
    with pytest.raises(ValueError, match=r"negative positions \[-3\]"):
        mlx_model.forward([1], [s], [-3], pool)
    with pytest.raises(ValueError, match="equal"):
        mlx_model.forward([1, 2], [s], [0, 1], pool)
    with pytest.raises(ValueError, match=r"tokens must be integer ids.*float64 values \[2\.5\]"):
        mlx_model.forward([2.5], [s], [0], pool)
    with pytest.raises(ValueError, match=r"logits_at \[1\] must index the batch's 1 rows"):
        mlx_model.forward([1], [s], [0], pool, logits_at=[1])
    with pytest.raises(ValueError, match=r"logits_at must be integer row indices.*float64"):
        mlx_model.forward([1], [s], [0], pool, logits_at=[0.0])
    assert pool.length(s) == 0  # refused before any layer wrote its rows


def test_load_metal_factory_shares_stats(tiny_dir):
    model, pool = load_metal(tiny_dir, "tq4", slots=2, max_context=32)
    assert pool.stats is model.stats and pool.tier.name == "tq4"
    s = pool.alloc_slot()
    model.forward([1, 2, 3], [s] * 3, [0, 1, 2], pool)
    drained = model.drain_fallbacks()
    assert drained["metal.paged_attention"] == model.config.num_hidden_layers
    assert model.drain_fallbacks() == {}


def test_polar_logits_close_to_numpy(models):
    """A polar tier runs on a metal worker through the numpy codec and attention (a fleet
    shares one tier): the logits of prefill and 8 decode steps match the numpy model's
    (tests/metal/test_metal_attention.py checks the counting)."""
    ref, mlx_model = models
    _, want = greedy(ref, KVPool, "polar4", PROMPT, 8)
    _, got = greedy(mlx_model, MLXKVPool, "polar4", PROMPT, 8)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())


def test_backend_selection_and_budget():
    from kernels.metal import backend
    assert backend.opted_out({"KVFLEET_METAL": "0"}) and backend.opted_out({"COLI_METAL": "off"})
    assert not backend.opted_out({"KVFLEET_METAL": "1", "COLI_METAL": ""})
    assert backend.device({"KVFLEET_METAL": "0"}) == mx.cpu
    assert backend.metal_enabled({}) == backend.metal_available()
    if not backend.metal_available():  # Linux: the MLX CPU backend, physical RAM
        assert backend.device({}) == mx.cpu
        import os
        assert backend.memory_budget() == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert backend.memory_budget() > 2 ** 28
