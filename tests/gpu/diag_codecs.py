"""Diagnostic (not a test): GPU codes of the hostile rows, saved for an offline comparison,
and whether this process's host float32 arithmetic flushes subnormals.

    python3 tests/gpu/diag_codecs.py OUT_DIR
"""
import sys

import cupy as cp
import numpy as np

sys.path.insert(0, "tests/gpu")
from test_codecs_gpu import hostile_rows  # noqa: E402

from kernels.cuda import codecs as gpu  # noqa: E402

tiny = np.float32(1e-40)
print("host float32: 1e-40 * 2 =", tiny * np.float32(2.0), "(0 means subnormals are flushed)")
out = {}
for tier in ("kv8", "tq4"):
    for n in (512, 64):
        x = hostile_rows(np.random.default_rng(n * 7 + len(tier)), n)
        c, s = gpu.encode_rows(tier, cp.asarray(x))
        out[f"{tier}_{n}_codes"], out[f"{tier}_{n}_scales"] = c.get(), s.get()
np.savez_compressed(sys.argv[1] + "/gpu_codes.npz", **out)
