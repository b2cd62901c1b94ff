"""The CUDA attention bench's floors (cluster/bench/attention.py), without a GPU."""
import pytest

from cluster.bench.attention import apply_floors, best_ceilings


def test_best_ceilings_takes_each_rate_at_its_highest():
    runs = [{"read_bytes_per_s": 4.41e12, "copy_bytes_per_s": 4.20e12, "f16_flops_per_s": 757e12},
            {"read_bytes_per_s": 4.38e12, "copy_bytes_per_s": 4.23e12, "f16_flops_per_s": 707e12}]
    assert best_ceilings(runs) == {"read_bytes_per_s": 4.41e12, "copy_bytes_per_s": 4.23e12,
                                   "f16_flops_per_s": 757e12}
    with pytest.raises(ValueError, match="no measurements"):
        best_ceilings([])


def test_floors_use_the_binding_ceiling():
    # (the copy rate, read + write bytes, is reported beside the read rate but is no floor)
    ceil = {"read_bytes_per_s": 4e12, "copy_bytes_per_s": 1e12, "f16_flops_per_s": 800e12}
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


def test_breakdown_times_every_variant_on_attention_cu(monkeypatch):
    """(on sm_90 kv8 / tq4 "full" and "1 CTA/SM" ran attn_wg while the SKIP variants ran
    attention.cu, those on a plan made for attn_wg's 1 CTA per SM at 16 heads instead of 2)"""
    import os
    import sys
    import types

    import kernels.cuda
    from cluster.bench import attention

    def wgmma():  # an sm_90 device: kernels/cuda/attention.py's choice for kv8 / tq4
        return os.environ.get("KVFLEET_CUDA_WGMMA", "1") != "0"

    runs = []

    def decode(tier, planes, tables, plan, q_lat, q_rope, scale, _skip=0, _two_ctas=True):
        runs.append(("wgmma" if wgmma() and not _skip else "attention.cu", plan))

    fake = types.SimpleNamespace(
        WG_ENV="KVFLEET_CUDA_WGMMA", paged_mla_decode=decode,
        ctas_per_sm=lambda tier, H, dl, dr: 1 if wgmma() or H > 16 else 2,
        head_groups=lambda tier, H, dl, dr: 1,
        decode_plan=lambda rows, positions, ctas_per_sm=1, head_groups=1: f"{ctas_per_sm} CTA/SM")
    cp = types.SimpleNamespace(float32="float32",
                               random=types.SimpleNamespace(standard_normal=lambda *a, **k: None),
                               get_default_memory_pool=lambda: types.SimpleNamespace(
                                   free_all_blocks=lambda: None))
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setitem(sys.modules, "kernels.cuda.attention", fake)
    monkeypatch.setattr(kernels.cuda, "attention", fake, raising=False)
    monkeypatch.setattr(attention, "_device_planes", lambda tier, B, T, rng: (None, None))
    monkeypatch.setattr(attention, "_graph_time", lambda fn, repeat: (fn(), (1e-3, "graph"))[1])
    monkeypatch.delenv("KVFLEET_CUDA_WGMMA", raising=False)
    args = types.SimpleNamespace(tiers=["kv8"], head_counts=[16], repeat=20)
    rows = attention.breakdown(args, {})
    assert list(rows[0]) == ["tier", "H", *attention.SKIPS, "1 CTA/SM"]
    assert {kernel for kernel, _ in runs} == {"attention.cu"}
    assert [plan for _, plan in runs] == ["2 CTA/SM"] * len(attention.SKIPS) + ["1 CTA/SM"]
    assert "KVFLEET_CUDA_WGMMA" not in os.environ  # (restored)
