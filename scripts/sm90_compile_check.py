"""Compile kernels/cuda/attention_sm90.cu for sm_90a on a machine without a GPU and report,
per shipped shape, what decides its speed before any device time is spent: spill bytes,
whether ptxas serialised the wgmmas (info C7514, or a wait for completion after every HGMMA
in the SASS), the number of local-memory loads inside the main loop and its length (the
static instructions from the first to the last HGMMA of a step: what the consumer warps
issue besides the products; at 64 heads session 4 took kv8 from 2158 to 1705, tq4 from 2725
to 2244; after session 5 kv8 1686 with 4 bytes of spills, tq4 2182 with none), and of it the
O^T part (from the barrier that publishes P^T to the last product: 384 at kv8 64 heads; the
unit ring of wip/unit-ring, which ran O^T 300-400 cycles slower, had 406-508). Session 7
(separate L and R rings, no branches in the softmax flag): kv8 64 heads 1556 with 8 bytes
of spills, tq4 2041 with none. Session 8 (kv8: P^T before the vote, SPEC): kv8 1793 with 16 bytes.
Session 9 (64 heads in clusters of two, evict-first copies): kv8 1781 with 16 bytes, tq4 2032
with none. Session 11 (one rescale bound, kv8's copies after the query loads, kv8's masks behind a
vote): kv8 1799 with none, tq4 2034 with none. Session 12 (M with -Inf as 0 in its own array):
kv8 1737 with none, tq4 2003 with none.

Needs the NVRTC that CuPy uses on the GPU machine (its ptxas allocates registers differently
from other CUDA versions, so check with the same one) and cuobjdump:

    pip download --no-deps nvidia-cuda-nvrtc-cu12 nvidia-cuda-cuobjdump -d /tmp/cu
    (cd /tmp/cu && for w in *.whl; do python3 -m zipfile -e "$w" x; done)
    python3 scripts/sm90_compile_check.py --nvrtc /tmp/cu/x/nvidia/cuda_nvrtc/lib/libnvrtc.so.12 \
        --cuobjdump /tmp/cu/x/nvidia/cu13/bin/cuobjdump [EXTRA=1 ...]

Extra NAME=VALUE arguments are added to every shape's defines (e.g. TMA=0, SB=4).
"""
from __future__ import annotations

import argparse
import ctypes
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from kernels.cuda._source import _source  # noqa: E402  (the text _build.py compiles: headers inlined)


def shapes() -> list[dict]:
    """The defines attention._wg_shape picks for GLM-5 widths (512 / 64), block size 16: four
    L slots and two R entries at 64 heads, five and three below; at 64 heads in clusters of
    two (_wg_cluster's choice on an H200 when every query has an even number of work items,
    as in the bench's shapes)."""
    out = []
    for tier in (1, 2):
        for hn in (16, 32, 64):
            ns, nr = (4, 2) if hn == 64 else (5, 3)
            cl = dict(CL=2) if hn == 64 else {}
            out.append(dict(TIER=tier, HN=hn, DL=512, DR=64, NSLOT=ns, NR=nr, CVT=1, TMA=1, BS=16,
                            **cl))
    return out


def compile_cubin(lib, src: str, defines: dict) -> tuple[bytes, str]:
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"attention_sm90.cu", 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    opts = [b"--std=c++17", b"--gpu-architecture=sm_90a", b"--ptxas-options=-v"]
    opts += [f"-D{k}={v}".encode() for k, v in defines.items()]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc:
        raise RuntimeError(f"NVRTC failed for {defines}:\n{log.value.decode()}")
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetCUBIN(prog, cubin)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return cubin.raw, log.value.decode()


def report(sass: str, log: str) -> str:
    ops = [ln.split("*/", 1)[1].strip().split(" ;")[0] for ln in sass.splitlines()
           if re.match(r"^\s+/\*[0-9a-f]{4,}\*/", ln)]
    hg = [i for i, op in enumerate(ops) if op.startswith("HGMMA")]
    loop = ops[hg[0]:hg[-1] + 1] if hg else []
    # O^T: its 32 products (8 groups x 4 m64 tiles at every head count) and what precedes
    # them back to the barrier that publishes P^T (kv8, SPEC: the vote's barrier.red)
    o0 = hg[-32] if len(hg) >= 32 else 0
    while o0 > 0 and not ops[o0].startswith(("BAR.SYNC", "BAR.RED")):  # (SPEC: the vote)
        o0 -= 1
    o_loop = ops[o0:hg[-1] + 1] if hg else []
    full_waits = sum("DEPBAR.LE gsb0, 0x0" in op for op in ops)
    spill = re.search(r"attn_wg\b.*?(\d+) bytes spill stores, (\d+) bytes spill loads", log, re.S)
    serial = "C7514" in log or (hg and full_waits >= len(hg))
    return (f"HGMMA {len(hg)}  waits-for-all {full_waits}  serialised {'YES' if serial else 'no'}  "
            f"spill st/ld {spill.group(1) + '/' + spill.group(2) if spill else '?'} B  "
            f"LDL in loop {sum(op.startswith('LDL') for op in loop)}  loop {len(loop)} instr  "
            f"(O^T {len(o_loop)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nvrtc", required=True, help="libnvrtc.so of the GPU machine's CUDA")
    ap.add_argument("--cuobjdump", required=True)
    ap.add_argument("extra", nargs="*", help="NAME=VALUE defines added to every shape")
    args = ap.parse_args()
    extra = {}
    for kv in args.extra:
        name, _, value = kv.partition("=")
        if not name.isidentifier() or not value.lstrip("-").isdigit():
            sys.exit(f"extra define {kv!r} must look like NAME=1")
        extra[name] = int(value)
    lib = ctypes.CDLL(args.nvrtc)
    src = _source("attention_sm90.cu")
    with tempfile.TemporaryDirectory() as tmp:
        for d in shapes():
            d.update(extra)
            cubin, log = compile_cubin(lib, src, d)
            path = Path(tmp) / "k.cubin"
            path.write_bytes(cubin)
            sass = subprocess.run([args.cuobjdump, "-sass", str(path)], capture_output=True,
                                  text=True, check=True).stdout
            tag = f"{'kv8' if d['TIER'] == 1 else 'tq4'} HN={d['HN']} TMA={d['TMA']}"
            print(f"{tag:18} {report(sass, log)}", flush=True)


if __name__ == "__main__":
    main()
