"""The CUDA attention bench's floors (cluster/bench/attention.py), without a GPU."""
import pytest

from cluster.bench.attention import apply_floors, best_ceilings


def test_best_ceilings_takes_each_rate_at_its_highest():
    runs = [{"copy_bytes_per_s": 4.20e12, "f16_flops_per_s": 757e12},
            {"copy_bytes_per_s": 4.23e12, "f16_flops_per_s": 707e12}]
    assert best_ceilings(runs) == {"copy_bytes_per_s": 4.23e12, "f16_flops_per_s": 757e12}
    with pytest.raises(ValueError, match="no measurements"):
        best_ceilings([])


def test_floors_use_the_binding_ceiling():
    ceil = {"copy_bytes_per_s": 4e12, "f16_flops_per_s": 800e12}
    # 16 x 32k, 64 heads, kv8: 73.0 GFLOP (0.0912 ms at 800 TFLOP/s) against 306 MB of
    # codes (0.0766 ms at 4 TB/s): bound by the FLOPs
    flops = 16 * 32768 * 2 * 64 * (576 + 512)
    rows = [{"ms": 0.1325, "bytes": 16 * 32768 * 584, "flops": flops},
            {"ms": 0.0500, "bytes": 400e6, "flops": 1e9}]
    apply_floors(rows, ceil)
    assert rows[0]["bound"] == "flops"
    assert rows[0]["floor_ms"] == pytest.approx(1e3 * flops / 800e12)
    assert rows[0]["x_floor"] == pytest.approx(0.1325 / rows[0]["floor_ms"])
    assert rows[1]["bound"] == "bytes" and rows[1]["floor_ms"] == pytest.approx(0.1)
    assert rows[1]["x_floor"] == pytest.approx(0.5)
