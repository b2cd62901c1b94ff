"""workers/fallbacks.py declares every kvfleet_fallbacks path, so the metrics endpoint can
start each at 0: every counting call in the package must name a declared path."""
import re
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

from kernels.tiers import TIERS
from workers.fallbacks import FALLBACK_PATHS

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kernels", "kvstore", "workers", "cluster")


def _sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for pkg in PACKAGES
            for p in sorted((ROOT / pkg).rglob("*.py"))}


def _calls(src: str, fn: str) -> list[str]:
    """The text after `fn(` at each call (not the def) in src."""
    return [src[m.end():m.end() + 120] for m in re.finditer(rf"(?<![\w.]){fn}\(", src)
            if not src[:m.start()].endswith("def ")]


def _counted() -> set[str]:
    """Every fallback path the package's counting calls can produce."""
    srcs, paths = _sources(), set()
    tiers = list(TIERS)
    for name, src in srcs.items():
        # kernels/cuda/attention.py: _count_fallback("name", ...), or the names of _choose_now's
        # (name, why) pairs, which paged_mla_decode counts
        for arg in _calls(src, "_count_fallback"):
            m = re.match(r'\s*"(\w+)"', arg)
            if m:
                paths.add(f"cuda.{m.group(1)}")
            else:
                assert arg.startswith("name, why)"), (name, arg)
                choose = re.search(r"\ndef _choose_now\(.*?(?=\ndef )", src, re.S).group(0)
                pairs = re.findall(r'\(\("(\w+)",', choose)
                assert pairs, name
                paths |= {f"cuda.{n}" for n in pairs}
        # kvstore/device_pool.py: self.counters.fallback("op", self.tier.name, ...)
        for arg in _calls(src, r"self\.counters\.fallback"):
            m = re.match(r'\s*"(\w+)", self\.tier\.name,', arg)
            assert m, (name, arg)
            paths |= {f"cuda.{m.group(1)}_{t}" for t in tiers}
        # kernels/metal: stats.count_fallback("name" | f"name_{tier.name}", ...)
        for arg in _calls(src, r"stats\.count_fallback"):
            m = re.match(r'\s*(f?)"(\w+?)(_\{tier\.name\})?"', arg)
            assert m and (m.group(1) == "f") == bool(m.group(3)), (name, arg)
            paths |= ({f"metal.{m.group(2)}_{t}" for t in tiers} if m.group(3)
                      else {f"metal.{m.group(2)}"})
        # workers: out["path"] = ... in the step's _drain_fallbacks
        for m in re.finditer(r'def _drain_fallbacks.*?(?=\n    def |\n\S|\Z)', src, re.S):
            for key in re.findall(r'out\[(.+?)\]', m.group(0)):
                assert re.fullmatch(r'"[\w.]+"', key), (name, key)
                paths.add(key.strip('"'))
    # every other place that counts is one of these (a new one must be scanned above), and
    # the metric counts only what the worker steps report
    sites = {n for n, s in srcs.items() if n != "workers/fallbacks.py" and re.search(
        r"count_fallback\(|counters\.fallback\(|def _drain_fallbacks", s)}
    metric = [(n, a) for n, s in srcs.items() for a in _calls(s, r"[\w.]*metrics\.fallback")]
    assert [(n, a.split(")")[0]) for n, a in metric] == [("cluster/scheduler.py", "path, n")]
    assert "for path, n in o.fallbacks.items():" in srcs["cluster/scheduler.py"]
    assert sites == {"kernels/cuda/attention.py", "kernels/metal/backend.py",
                     "kernels/metal/attention.py", "kernels/metal/codecs.py",
                     "kvstore/device_pool.py", "workers/actor.py", "workers/ep_worker.py"}, sites
    return paths


def test_every_counted_fallback_path_is_declared():
    """(the kvfleet_fallbacks paths were not started at 0 on the endpoint, read as 'not
    known in advance': they are literals at a few counting calls, times the tier names)"""
    counted = _counted()
    assert {"cpu.polar_rebuild_rows", "cuda.host_model_steps", "cuda.attend_polar3",
            "cuda.attn_split_smem", "cuda.pdl_refused", "metal.paged_attention",
            "metal.encode_polar3"} <= counted
    assert counted <= set(FALLBACK_PATHS), sorted(counted - set(FALLBACK_PATHS))
    assert len(set(FALLBACK_PATHS)) == len(FALLBACK_PATHS)


def test_the_models_drain_declared_paths(fake_cupy):
    """CudaModel / MLXModel.drain_fallbacks name their paths as declared (cuda.<op>_<tier>,
    cuda.<kernel name>, metal.<name>)."""
    fake_cupy(cc="89", per_sm=102400, optin=101376)
    from kernels.cuda import attention as A
    from workers.cuda_model import CudaModel
    A._count_fallback("attn_split_smem", "a smaller tile")
    pool = SimpleNamespace(counters=SimpleNamespace(fallbacks=Counter({("attend", "f32"): 3})))
    model = SimpleNamespace(pool=pool, _fallbacks_seen={})
    assert CudaModel.drain_fallbacks(model) == {"cuda.attn_split_smem": 1, "cuda.attend_f32": 3}
    assert CudaModel.drain_fallbacks(model) == {}
    from kernels.metal.backend import KernelStats
    from workers.mlx_model import MLXModel
    stats = KernelStats()
    stats.count_fallback("paged_attention", "no Metal")
    stats.count_fallback("encode_polar3", "no MLX codec")
    drained = MLXModel.drain_fallbacks(SimpleNamespace(stats=stats))
    assert drained == {"metal.paged_attention": 1, "metal.encode_polar3": 1}
    assert set(drained) <= set(FALLBACK_PATHS)
