"""The tiny model with its KV cache and attention on the GPU (DevicePool: planes in device
memory, rows encoded by the CUDA encoders, attention by the CUDA kernel; weights and the
other layers stay in numpy) gives the CPU pool's greedy tokens over 64 steps."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from kernels.cuda._build import cuda_available  # noqa: E402

if not cuda_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from kvstore.device_pool import DevicePool  # noqa: E402
from kvstore.pool import KVPool  # noqa: E402
from workers.model import Model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STEPS = 64


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("make_tiny_model",
                                                  ROOT / "scripts" / "make_tiny_model.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    return maker.make_tiny_model(tmp_path_factory.mktemp("tiny"), 0, ())


def greedy(model, pool, prompt, steps):
    s = pool.alloc_slot()
    n = len(prompt)
    logits = model.forward(prompt, [s] * n, np.arange(n), pool, logits_at=[n - 1])
    out = []
    for step in range(steps):
        tok = int(logits[-1].argmax())
        out.append(tok)
        logits = model.forward([tok], [s], [n + step], pool)
    return out


@pytest.mark.parametrize("tier", ["f32", "kv8"])
def test_tiny_model_greedy_equal_with_gpu_kv(tiny_dir, tier):
    model = Model.load(tiny_dir)
    cfg = model.config
    prompt = [0, 17, 42, 99, 5, 230, 7, 300, 12, 64]
    cpu = greedy(model, KVPool.for_model(cfg, tier, 1, 128), prompt, STEPS)
    dev_pool = DevicePool.for_model(cfg, tier, 1, 128)
    gpu = greedy(model, dev_pool, prompt, STEPS)
    assert gpu == cpu, f"{tier}: first difference at step {next(i for i, (a, b) in enumerate(zip(gpu, cpu)) if a != b)}"
    m = dev_pool.metrics()
    # every K/V row was uploaded once, when written: 2 rows per token per layer
    assert m["rows_uploaded"] == 2 * cfg.num_hidden_layers * (len(prompt) + STEPS)
    assert not dev_pool.counters.fallbacks
