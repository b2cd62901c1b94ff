"""DevicePool: same results as the host KVPool, host rows uploaded once (never per step),
CPU fallback for tiers without a CUDA kernel counted and logged once."""
import logging

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from kernels.cuda._build import cuda_available  # noqa: E402

if not cuda_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from kvstore.device_pool import DevicePool  # noqa: E402
from kvstore.pool import KVPool  # noqa: E402

DL, DR = 512, 64
SCALE = 1.0 / np.sqrt(192.0)


def fill(pools, rng, lengths, layers=2):
    """Same prefill into every pool: slot i gets lengths[i] tokens, written in chunks."""
    slots = [[p.alloc_slot() for _ in lengths] for p in pools]
    assert all(s == slots[0] for s in slots)
    for layer in range(layers):
        for s, n in zip(slots[0], lengths):
            for a in range(0, n, 97):
                pos = np.arange(a, min(n, a + 97))
                L = rng.standard_normal((len(pos), DL)).astype(np.float32)
                R = rng.standard_normal((len(pos), DR)).astype(np.float32)
                for p in pools:
                    p.write(layer, np.full(len(pos), s), pos, L, R)
    return slots[0]


def rel(a, b):
    """Largest relative L2 error of one query's context (all heads), as in the attention test."""
    a, b = a.reshape(len(a), -1), b.reshape(len(b), -1)
    return (np.linalg.norm(a - b, axis=1) / np.linalg.norm(b, axis=1)).max()


@pytest.mark.parametrize("tier", ["f32", "kv8", "tq4"])
def test_device_pool_matches_host_pool_and_uploads_once(tier):
    rng = np.random.default_rng(3)
    kw = dict(n_layers=2, kv_lora=DL, rope=DR, tier=tier, n_blocks=300, max_slots=4)
    host, dev = KVPool(**kw), DevicePool(**kw)
    lengths = [5, 700, 1300]
    slots = fill([host, dev], rng, lengths)
    rows = 2 * sum(lengths) * 2  # L and R rows, two layers
    assert dev.counters.rows_uploaded == rows
    up_bytes = dev.counters.bytes_uploaded
    for layer in range(2):  # coded rows equal the host pool's bit for bit
        for s in slots:
            for a, b in zip(dev.read_rows(s, layer), host.read_rows(s, layer)):
                assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    positions = np.array([n - 1 for n in lengths])
    H = 16
    for step in range(3):  # decode steps: attend only, no row crosses the bus
        ql = rng.standard_normal((3, H, DL)).astype(np.float32)
        qr = rng.standard_normal((3, H, DR)).astype(np.float32)
        for layer in range(2):
            want = host.attend(layer, slots, positions, ql, qr, SCALE)
            got = dev.attend(layer, slots, positions, cp.asarray(ql), cp.asarray(qr), SCALE)
            assert isinstance(got, cp.ndarray)
            assert rel(got.get(), want) < 2e-3
    assert dev.counters.rows_uploaded == rows and dev.counters.bytes_uploaded == up_bytes
    assert not dev.counters.fallbacks


def test_device_tables_follow_truncate_and_new_blocks():
    rng = np.random.default_rng(4)
    kw = dict(n_layers=1, kv_lora=DL, rope=DR, tier="kv8", n_blocks=40, max_slots=2)
    host, dev = KVPool(**kw), DevicePool(**kw)
    (s,) = fill([host, dev], rng, [200], layers=1)
    for p in (host, dev):
        p.truncate(s, 33)
    L = rng.standard_normal((100, DL)).astype(np.float32)
    R = rng.standard_normal((100, DR)).astype(np.float32)
    for p in (host, dev):
        p.write(0, np.full(100, s), np.arange(33, 133), L, R)
    ql = rng.standard_normal((1, 16, DL)).astype(np.float32)
    qr = rng.standard_normal((1, 16, DR)).astype(np.float32)
    got = dev.attend(0, [s], [132], ql, qr, SCALE)  # numpy in, numpy out
    assert isinstance(got, np.ndarray)
    assert rel(got, host.attend(0, [s], [132], ql, qr, SCALE)) < 2e-3


def test_polar_falls_back_to_cpu_counted_and_logged_once(caplog):
    rng = np.random.default_rng(5)
    kw = dict(n_layers=1, kv_lora=DL, rope=DR, tier="polar3", n_blocks=30, max_slots=2)
    host, dev = KVPool(**kw), DevicePool(**kw)
    with caplog.at_level(logging.WARNING, logger="kvstore.device_pool"):
        (s,) = fill([host, dev], rng, [150], layers=1)
        ql = rng.standard_normal((1, 4, DL)).astype(np.float32)
        qr = rng.standard_normal((1, 4, DR)).astype(np.float32)
        for _ in range(3):
            got = dev.attend(0, [s], [149], ql, qr, SCALE)
    want = host.attend(0, [s], [149], ql, qr, SCALE)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert dev.counters.fallbacks[("encode", "polar3")] == 2  # two write calls
    assert dev.counters.fallbacks[("attend", "polar3")] == 3
    m = dev.metrics()
    assert m["fallback_attend_polar3"] == 3 and m["fallback_encode_polar3"] == 2
    warnings = [r for r in caplog.records if "falls back to the CPU" in r.getMessage()]
    assert len(warnings) == 2  # once per (op, tier), not once per call


def test_kv8_nan_codes_are_stored_as_zero():
    """e4m3 NaN codes (0x7F / 0xFF) in uploaded coded rows decode to 0 in the contract; the
    device pool stores them as 0x00 so the hardware conversion of the sm_90a kernel agrees."""
    rng = np.random.default_rng(5)
    kw = dict(n_layers=1, kv_lora=DL, rope=DR, tier="kv8", n_blocks=40, max_slots=2)
    host, dev = KVPool(**kw), DevicePool(**kw)
    n = 300
    lc = rng.integers(0, 256, (n, DL)).astype(np.uint8)
    rc = rng.integers(0, 256, (n, DR)).astype(np.uint8)
    lc[:, :7] = 0x7F
    rc[:, :3] = 0xFF
    ls = rng.uniform(0.005, 0.02, n).astype(np.float32)
    rs = rng.uniform(0.005, 0.02, n).astype(np.float32)
    for p in (host, dev):
        s = p.alloc_slot()
        p.write_coded(0, np.full(n, s), np.arange(n), lc, ls, rc, rs)
    got = dev.read_rows(s, 0)
    assert not ((got[0] & 0x7F) == 0x7F).any() and not ((got[2] & 0x7F) == 0x7F).any()
    ql = rng.standard_normal((1, 16, DL)).astype(np.float32)
    qr = rng.standard_normal((1, 16, DR)).astype(np.float32)
    want = host.attend(0, [s], [n - 1], ql, qr, SCALE)
    out = dev.attend(0, [s], [n - 1], ql, qr, SCALE)
    assert np.isfinite(out).all() and rel(out, want) < 2e-3
