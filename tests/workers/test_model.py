"""Model logits vs the independent float64 reference, and decode-through-cache consistency."""
from __future__ import annotations

import numpy as np
import pytest

from kvstore.pool import KVPool
from mla_reference import reference_logits
from workers.model import Model

VARIANTS = [(), ("no_q_lora",), ("softmax",), ("softmax_grouped",), ("yarn",), ("tied",),
            ("multi_eos",), ("half_rope",), ("sharded",), ("f32",), ("glm",),
            ("no_q_lora", "half_rope", "yarn", "tied")]
IDS = [5, 300, 17, 42, 511, 0, 99, 250, 7, 123, 64, 1, 480, 33]


def rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def new_pool(model, slots=4, max_ctx=64, block_size=4, tier="f32"):
    return KVPool.for_model(model.config, tier, slots=slots, max_ctx=max_ctx, block_size=block_size)


@pytest.fixture(scope="module")
def models(tiny):
    cache = {}

    def get(*variants):
        if variants not in cache:
            cache[variants] = (Model.load(tiny(*variants)), tiny(*variants))
        return cache[variants]
    return get


@pytest.mark.parametrize("variants", VARIANTS, ids=lambda v: "+".join(v) or "base")
def test_prefill_and_decode_match_reference(models, variants):
    model, d = models(*variants)
    ref = reference_logits(d, IDS)
    pool = new_pool(model)
    pool.alloc_slot()  # slot 0 taken: the tested slot's blocks are not the first ones
    s = pool.alloc_slot()
    n0 = 9
    pre = model.forward(IDS[:n0], [s] * n0, np.arange(n0), pool)
    assert rel_err(pre, ref[:n0]) < 1e-5
    dec = [model.forward([t], [s], [n0 + j], pool)[0] for j, t in enumerate(IDS[n0:])]
    assert rel_err(np.array(dec), ref[n0:]) < 1e-5
    assert np.isfinite(pre).all()


@pytest.mark.parametrize("tier", ["kv8", "tq4", "polar4"])
def test_quantized_tier_matches_reference_with_roundtripped_rows(models, tier):
    """Through a kv8/tq4 pool the model equals the reference whose cached rows went through
    the tier's codec (encode -> decode), and clearly differs from the f32 logits."""
    from kernels.cpu.codecs import decode_rows, encode_rows

    def roundtrip(rows):
        return decode_rows(tier, *encode_rows(tier, rows.astype(np.float32)), rows.shape[-1]).astype(np.float64)

    model, d = models()
    pool = new_pool(model, tier=tier)
    s = pool.alloc_slot()
    got = model.forward(IDS, [s] * len(IDS), np.arange(len(IDS)), pool)
    ref = reference_logits(d, IDS, kv_roundtrip=roundtrip)
    assert rel_err(got, ref) < 1e-5
    assert rel_err(got, reference_logits(d, IDS)) > 1e-2  # the tier is really in the path


def test_token_by_token_decode_equals_one_prefill(models):
    model, _ = models()
    pool = new_pool(model)
    a, b = pool.alloc_slot(), pool.alloc_slot()
    full = model.forward(IDS, [a] * len(IDS), np.arange(len(IDS)), pool)
    steps = np.array([model.forward([t], [b], [i], pool)[0] for i, t in enumerate(IDS)])
    assert rel_err(steps, full) < 1e-5
    last = model.forward(IDS[-1:], [a], [len(IDS) - 1], pool)  # rewrite of the last row
    np.testing.assert_allclose(last[0], full[-1], rtol=0, atol=1e-5 * np.abs(full).max())


def test_logits_at_selects_rows(models):
    model, _ = models()
    pool = new_pool(model)
    s = pool.alloc_slot()
    full = model.forward(IDS, [s] * len(IDS), np.arange(len(IDS)), pool)
    s2 = pool.alloc_slot()
    some = model.forward(IDS, [s2] * len(IDS), np.arange(len(IDS)), pool, logits_at=[len(IDS) - 1, 2])
    np.testing.assert_allclose(some, full[[len(IDS) - 1, 2]], rtol=0, atol=1e-6)


def test_ragged_multi_slot_decode_equals_single_slot_runs(models):
    model, _ = models("yarn")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 512, n).tolist() for n in (3, 11, 6)]
    steps = 5
    conts = [rng.integers(0, 512, steps).tolist() for _ in prompts]
    # single-slot runs, each in its own pool
    single = []
    for p, cont in zip(prompts, conts):
        pool = new_pool(model, slots=1)
        s = pool.alloc_slot()
        ids = p + cont
        single.append(model.forward(ids, [s] * len(ids), np.arange(len(ids)), pool)[len(p):])
    # one pool, slots allocated around a freed one, prefills then batched shuffled decode
    pool = new_pool(model, slots=5)
    junk = pool.alloc_slot()
    slots = [pool.alloc_slot() for _ in prompts]
    model.forward([9, 8, 7, 6, 5], [junk] * 5, np.arange(5), pool)
    pool.free_slot(junk)  # its blocks (full of stale rows) go to the free list
    for s, p in zip(slots[::-1], prompts[::-1]):
        model.forward(p, [s] * len(p), np.arange(len(p)), pool)
    got = np.zeros((len(prompts), steps, model.config.vocab_size), np.float32)
    for j in range(steps):
        order = rng.permutation(len(prompts))
        lg = model.forward([conts[i][j] for i in order], [slots[i] for i in order],
                           [len(prompts[i]) + j for i in order], pool)
        got[order, j] = lg
    for i in range(len(prompts)):
        assert rel_err(got[i], single[i]) < 1e-5, f"slot {i}"


def test_mixed_prefill_and_decode_in_one_call(models):
    model, _ = models()
    pool = new_pool(model)
    a, b = pool.alloc_slot(), pool.alloc_slot()
    model.forward(IDS[:5], [a] * 5, np.arange(5), pool)
    mixed = model.forward([IDS[5]] + IDS[:4], [a] + [b] * 4, [5, 0, 1, 2, 3], pool)
    ref = reference_logits(models()[1], IDS[:6])
    assert rel_err(mixed[:1], ref[5:6]) < 1e-5
    assert rel_err(mixed[1:], ref[:4]) < 1e-5


def test_bad_inputs_are_errors(models):
    model, _ = models()
    pool = new_pool(model)
    s = pool.alloc_slot()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.forward([512], [s], [0], pool)
    with pytest.raises(ValueError, match="equal"):
        model.forward([1, 2], [s], [0, 1], pool)


def test_dsa_model_says_once_that_it_attends_densely_past_index_topk(tiny, caplog):
    import dataclasses
    import logging

    from kvstore.pool import KVPool
    from workers.model import Model
    m = Model.load(tiny("glm"))
    m.config = dataclasses.replace(m.config, index_topk=8)  # a short index_topk for the test
    pool = KVPool.for_model(m.config, "f32", slots=1, max_ctx=32)
    s = pool.alloc_slot()
    with caplog.at_level(logging.WARNING, logger="workers.model"):
        m.forward(np.arange(8), np.full(8, s), np.arange(8), pool)  # exactly index_topk: quiet
        assert not m.dense_past_topk and "index_topk" not in caplog.text
        m.forward(np.arange(3), np.full(3, s), np.arange(8, 11), pool)
        m.forward([3], [s], [11], pool)
    assert m.dense_past_topk
    assert caplog.text.count("past index_topk=8") == 1


@pytest.mark.parametrize("field, tokens, slots, positions, match", [
    ("tokens", [3.5], None, [0], r"tokens must be integer ids.*float64.*\[3\.5\]"),
    ("tokens", np.array([3.0, 4.0]), None, [0, 1], r"tokens must be integer ids.*float64"),
    ("tokens", [True, 5], None, [0, 1], r"tokens must be integer ids.*bool"),
    ("tokens", np.array([True]), None, [0], r"tokens must be integer ids.*bool"),
    ("tokens", ["7"], None, [0], r"tokens must be integer ids"),
    ("tokens", [-1], None, [0], r"token ids \[-1\] are outside the vocabulary \[0, 512\)"),
    ("tokens", [2 ** 63 + 5], None, [0],
     r"tokens must be integer ids \(int64 values\), got uint64 values \[9223372036854775813\]"),
    ("slots", [1], [0.0], [0], r"slots must be integer ids.*float64"),
    ("positions", [1], None, [0.5], r"positions must be integer ids.*float64"),
    ("positions", [1], None, [False], r"positions must be integer ids.*bool"),
])
def test_non_integer_ids_are_named_errors(models, field, tokens, slots, positions, match):
    """Float, bool, string or out-of-int64 ids are refused, naming the argument (np.int64
    casts used to truncate 3.5 to token 3 and read True as token 1), before any KV is written."""
    from workers.model import BatchError
    model, _ = models()
    pool = new_pool(model)
    s = pool.alloc_slot()
    with pytest.raises(BatchError, match=match):
        model.forward(tokens, [s] * len(tokens) if slots is None else slots, positions, pool)
    assert pool.length(s) == 0


@pytest.mark.parametrize("logits_at, match", [
    ([14], r"logits_at \[14\] must index the batch's 14 rows \(0\.\.13\)"),
    ([-1], r"logits_at \[-1\] must index the batch's 14 rows"),
    ([2.0], r"logits_at must be integer row indices.*float64"),
    ([True], r"logits_at must be integer row indices.*bool"),
    ([[1, 2]], r"logits_at must be one-dimensional, got shape \(1, 2\)"),
])
def test_bad_logits_at_is_a_named_error_before_the_cache_is_written(models, logits_at, match):
    """logits_at picks rows of this batch: a row past the end was an IndexError after every
    layer had written its KV rows, a negative one silently picked a row from the end."""
    from workers.model import BatchError
    model, _ = models()
    pool = new_pool(model)
    s = pool.alloc_slot()
    with pytest.raises(BatchError, match=match):
        model.forward(IDS, [s] * len(IDS), np.arange(len(IDS)), pool, logits_at=logits_at)
    assert pool.length(s) == 0
    none = model.forward(IDS, [s] * len(IDS), np.arange(len(IDS)), pool, logits_at=[])
    assert none.shape == (0, model.config.vocab_size)
    ints = model.forward(IDS, [s] * len(IDS), np.arange(len(IDS)), pool,
                         logits_at=np.array([3, 3, 0], np.uint8))
    assert ints.shape == (3, model.config.vocab_size)


def test_model_with_no_moe_layer_runs_and_matches_reference(maker, tmp_path):
    """A deepseek_v3 config.json with 2 layers and no first_k_dense_replace (default 3): every
    layer dense, as transformers builds it; it loads (no expert tensors) and matches the
    reference, which is told the same schedule explicitly."""
    import json
    from workers.config import ModelConfig
    from workers.safetensors_io import save_file
    raw = maker.base_config(set())
    raw["num_hidden_layers"] = 2
    del raw["first_k_dense_replace"]
    d, ref_dir = tmp_path / "m", tmp_path / "ref"
    for out, cfg in ((d, raw), (ref_dir, {**raw, "first_k_dense_replace": 2})):
        out.mkdir()
        (out / "config.json").write_text(json.dumps(cfg))
    tensors = maker.random_tensors(ModelConfig.from_file(d), seed=3)
    assert not any(".mlp.experts." in n or ".mlp.gate." in n for n in tensors)
    for out in (d, ref_dir):
        save_file(out / "model.safetensors", tensors, "F32")
    model = Model.load(d)
    assert [layer.moe for layer in model.layers] == [None, None]
    pool = new_pool(model)
    s = pool.alloc_slot()
    n0 = 9
    pre = model.forward(IDS[:n0], [s] * n0, np.arange(n0), pool)
    dec = [model.forward([t], [s], [n0 + j], pool)[0] for j, t in enumerate(IDS[n0:])]
    ref = reference_logits(ref_dir, IDS)
    assert rel_err(pre, ref[:n0]) < 1e-5 and rel_err(np.array(dec), ref[n0:]) < 1e-5
