"""The CuPy model (workers/cuda_model.py: weights on the GPU, cuBLAS f32 matmuls, KV cache in
a DevicePool) against the numpy model on the host pool.

Tolerance: the CUDA attention kernel rounds K/V, queries and softmax weights to f16 (about
2e-3 relative error per context, tests/gpu/test_attention_gpu.py); every other op is f32.
Logits must agree to a relative L2 error of LOGIT_RTOL[tier] per row: f32 is the f16
attention alone (seen: <= 9.6e-4); on kv8 and tq4 the small f32 differences of the latent
rows also flip some codes (a kv8 element by up to 1/8, a tq4 one by a level gap), so
those tiers get more room (seen on the H200: kv8 <= 6.1e-3, tq4 1.6e-2). Greedy decoding
must give the same tokens over 64 steps; a flip that the measured logit error explains (a near-tie)
is reported as an expected failure with its figures (run with -rx to see them)."""
from pathlib import Path

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from kernels.cuda._build import cuda_available  # noqa: E402

if not cuda_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from kvstore.device_pool import DevicePool  # noqa: E402
from kvstore.pool import KVPool  # noqa: E402
from workers.cuda_model import CudaModel, load_cuda  # noqa: E402
from workers.model import Model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MINI = ROOT / "models" / "kvfleet-mini"
STEPS = 64
LOGIT_RTOL = {"f32": 3e-3, "kv8": 2e-2, "tq4": 5e-2}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from scripts.make_tiny_model import make_tiny_model  # repo root on pytest's pythonpath
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), 0, ())


def greedy(model, pool, prompt, steps):
    """(tokens, per-step logits) of greedy decoding from a one-slot prefill."""
    s = pool.alloc_slot()
    n = len(prompt)
    logits = model.forward(prompt, [s] * n, np.arange(n), pool, logits_at=[n - 1])[-1]
    out, rows = [], []
    for step in range(steps):
        rows.append(logits)
        out.append(int(logits.argmax()))
        logits = model.forward([out[-1]], [s], [n + step], pool)[-1]
    return out, rows


def rel_rows(a, b):
    return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)


def compare_greedy(model_dir, tier, prompt):
    """Greedy tokens equal over STEPS, logits within LOGIT_RTOL[tier] at every step. A differing
    token is an expected failure (xfail, with the figures) only where it is a near-tie the
    measured logit error explains: the CPU's top-2 margin there <= 2 x max |gpu - cpu|."""
    cpu_model = Model.load(model_dir)
    gpu_model, pool = load_cuda(model_dir, tier, 1, 160)
    cpu, cpu_rows = greedy(cpu_model, KVPool.for_model(cpu_model.config, tier, 1, 160), prompt, STEPS)
    gpu, gpu_rows = greedy(gpu_model, pool, prompt, STEPS)
    same = next((i for i, (a, b) in enumerate(zip(gpu, cpu)) if a != b), STEPS)
    err = rel_rows(np.array(gpu_rows[:same + 1]), np.array(cpu_rows[:same + 1]))
    print(f"\n{model_dir.name} {tier}: greedy tokens equal for {same} of {STEPS} steps, "
          f"logits rel err max {err.max():.2e} median {np.median(err):.2e}")
    assert err.max() < LOGIT_RTOL[tier], f"logits rel err {err.max():.3g} (step {err.argmax()})"
    assert not pool.counters.fallbacks
    assert pool.counters.rows_uploaded == 0  # rows are made on the device, never uploaded
    if same < STEPS:
        top2 = np.sort(cpu_rows[same])[-2:]
        margin, dev = top2[1] - top2[0], np.abs(gpu_rows[same] - cpu_rows[same]).max()
        msg = (f"{model_dir.name} {tier}: greedy tokens equal for {same} of {STEPS} steps, then "
               f"gpu {gpu[same]} cpu {cpu[same]}: cpu top-2 margin {margin:.3g}, max |gpu - cpu| "
               f"logit {dev:.3g}, rel err {err[-1]:.3g}; logits within {LOGIT_RTOL[tier]} up to there")
        if margin <= 2 * dev:
            pytest.xfail("near-tie flip: " + msg)
        pytest.fail(msg)


@pytest.mark.parametrize("tier", ["f32", "kv8"])
def test_tiny_model_greedy_equal_on_gpu(tiny_dir, tier):
    compare_greedy(tiny_dir, tier, [0, 17, 42, 99, 5, 230, 7, 300, 12, 64])


@pytest.mark.parametrize("tier", ["f32", "kv8"])
def test_shipped_model_greedy_equal_on_gpu(tier):
    from workers.tokenizer import Tokenizer
    prompt = Tokenizer.from_dir(MINI).encode("Once upon a time there was a small model that")
    compare_greedy(MINI, tier, prompt)


@pytest.mark.parametrize("tier", ["f32", "kv8", "tq4"])
def test_logits_prefill_and_ragged_decode_match_numpy(tiny_dir, tier):
    """Three slots, their blocks shuffled (NaN in every unwritten row): prefill chunks of two
    slots in one flat batch, a third slot's prefill, then ragged decode steps of all three
    (different lengths, one token each) with logits asked for a subset of rows."""
    rng = np.random.default_rng(7)
    cpu_model = Model.load(tiny_dir)
    gpu_model = CudaModel.load(tiny_dir)
    cfg = cpu_model.config
    host = KVPool.for_model(cfg, tier, 3, 96)
    dev = DevicePool.for_model(cfg, tier, 3, 96)
    perm = rng.permutation(host.n_blocks).tolist()  # same shuffled block order in both
    host._free_blocks, dev._free_blocks = list(perm), list(perm)
    slots = [host.alloc_slot() for _ in range(3)]
    assert [dev.alloc_slot() for _ in range(3)] == slots
    hist = rng.integers(0, cfg.vocab_size, (3, 40))
    lens = [23, 9, 31]

    errs = []

    def both(tokens, sl, pos, at):
        want = cpu_model.forward(tokens, sl, pos, host, logits_at=at)
        got = gpu_model.forward(tokens, sl, pos, dev, logits_at=at)
        assert got.dtype == np.float32 and got.shape == want.shape
        errs.append(rel_rows(got, want).max())
        assert errs[-1] < LOGIT_RTOL[tier], rel_rows(got, want)

    # prefill: slots 0 and 1 mixed in one batch (two chunks), then slot 2
    tok = np.concatenate([hist[0, :lens[0]], hist[1, :lens[1]]])
    sl = np.repeat(slots[:2], lens[:2])
    pos = np.concatenate([np.arange(lens[0]), np.arange(lens[1])])
    both(tok, sl, pos, None)  # every row's logits
    both(hist[2, :lens[2]], [slots[2]] * lens[2], np.arange(lens[2]), [lens[2] - 1])
    for step in range(5):  # ragged decode, logits for rows 2 and 0 (in that order)
        pos = np.array(lens) + step
        both(hist[np.arange(3), pos], slots, pos, [2, 0])
    print(f"\ntiny {tier}: logits rel err prefill {max(errs[:2]):.2e}, ragged decode "
          f"{max(errs[2:]):.2e}")
    assert not dev.counters.fallbacks and dev.counters.rows_uploaded == 0
