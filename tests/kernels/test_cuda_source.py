"""kernels/cuda/_source.py: the text that _build.py compiles and scripts/sm90_compile_check.py
inspects, with local headers inlined (no CuPy or GPU needed)."""
import os
import re

from kernels.cuda import _source as src

CUDA_DIR = os.path.dirname(src.__file__)


def test_every_kernel_source_has_its_local_headers_inlined_once():
    names = sorted(n for n in os.listdir(CUDA_DIR) if n.endswith(".cu"))
    assert {"attention.cu", "attention_sm90.cu", "codecs.cu"} <= set(names)
    for name in names:
        text = src._source(name)
        assert not re.search(r'^\s*#\s*include\s+"', text, re.M), f"{name}: a local #include is left"
        with open(os.path.join(CUDA_DIR, name), encoding="utf-8") as f:
            raw = f.read()
        for header in re.findall(r'^\s*#\s*include\s+"([^"]+)"', raw, re.M):
            with open(os.path.join(CUDA_DIR, header), encoding="utf-8") as f:
                body = f.read()
            assert text.count(body) == 1, f"{name}: {header} inlined {text.count(body)} times"
    # codecs.cu and attention.cu share the rotation's sign hash: its one definition each
    for name in ("codecs.cu", "attention.cu"):
        assert src._source(name).count("bool neg_sign(") == 1


def test_a_header_included_twice_is_inlined_once(tmp_path, monkeypatch):
    (tmp_path / "h.cuh").write_text("int h_once;\n")
    (tmp_path / "g.cuh").write_text('#include "h.cuh"\nint g_once;\n')
    (tmp_path / "k.cu").write_text('#include "h.cuh"\n  # include "g.cuh"\nint k;\n')
    monkeypatch.setattr(src, "_HERE", str(tmp_path))
    assert src._expand("k.cu", set()) == "int h_once;\nint g_once;\nint k;\n"
