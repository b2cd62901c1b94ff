"""fp8 (OCP e4m3fn) row codec of the `kv8` tier with MLX ops, bit-identical to
kernels/cpu/fp8.py (the contract is in DESIGN.md "KV tiers" and that module's docstring).

The encoder works on float32 bit patterns with integer ops, as the numpy one does: RNE to
3 mantissa bits is (m + 0x7FFFF + lsb) >> 20, the exponent rebias subtracts 120 << 3, values
below 2^-6 take the subnormal code rint(a * 2^9), above 448 (and Inf) saturate to 0x7E, NaN
encodes to 0x00 -- all on the integer bits except the subnormal rint. Per row, only
max/abs/multiply and bit ops run on the compute device; the two per-row divisions
(448/amax and amax/448) run on the CPU stream, where IEEE division is correctly rounded
(Metal's fast-math division need not be). NaN is found by bit tests, not
isnan (which fast math may fold away). `enc` has no float add, so it may be fused.
"""
from __future__ import annotations

import mlx.core as mx

from kernels.cpu import fp8 as ref

_TABLE = mx.array(ref.DECODE_TABLE)


def _u32(v: int) -> mx.array:
    return mx.array(v, dtype=mx.uint32)


def row_scale(x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """x[R, n] -> (live[R] bool, inv[R] = 448/amax, scale[R] = amax/448 or 1 when inert)."""
    a = mx.abs(x)
    is_nan = (x.view(mx.uint32) & _u32(0x7FFFFFFF)) > _u32(0x7F800000)  # bit test: no
    amax = mx.max(mx.where(is_nan, mx.array(0.0, mx.float32), a), axis=-1)  # isnan under fast math
    live = (amax > ref._TINY.item()) & ~(amax > ref._HUGE.item())
    safe = mx.where(live, amax, mx.array(448.0, mx.float32))
    inv = mx.divide(mx.array(448.0, mx.float32), safe, stream=mx.cpu)
    scale = mx.where(live, mx.divide(safe, mx.array(448.0, mx.float32), stream=mx.cpu),
                     mx.array(1.0, mx.float32))
    return live, inv, scale


def _enc(u: mx.array, f: mx.array) -> mx.array:
    """enc() from the uint32 bit patterns u of the float32 values f (both passed, since a
    bit view cannot sit inside a shapeless fused kernel)."""
    m = u & 0x7FFFFFFF
    sign = (u >> 24) & 0x80
    normal = ((m + 0x7FFFF + ((m >> 20) & 1)) >> 20) - (120 << 3)
    # below 2^-6: rint(|f| * 2^9); the multiply by a power of two is exact and rint rounds
    # half to even in IEEE and fast-math modes alike (flushed subnormals give 0 either way)
    sub = mx.round(mx.abs(f) * 512.0).astype(mx.uint32)
    code = mx.where(m < 0x3C800000, sub, normal)        # below 2^-6: subnormal code
    code = mx.where(m > 0x43E00000, 0x7E, code)          # > 448 and Inf saturate
    code = mx.where(m > 0x7F800000, 0, code | sign)      # NaN -> 0x00
    return code.astype(mx.uint8)


# Bit ops, one exact multiply by 512 and rint: fusing them cannot change a bit (no add to
# contract into an fma, nothing fast math may relax).
# Fused on the GPU only: on MLX's CPU backend a fused kernel is built by the system C++
# compiler (tens of seconds on first use per machine), so there the ops run one by one.
_enc_fused = mx.compile(_enc, shapeless=True)


def enc(f: mx.array) -> mx.array:
    """The contract's enc() of float32 values (already multiplied by inv) -> uint8 codes."""
    fn = _enc_fused if mx.default_device() == mx.gpu else _enc
    f = f.astype(mx.float32)
    return fn(f.view(mx.uint32), f)


def encode(x: mx.array) -> tuple[mx.array, mx.array]:
    """x[R, n] float32 -> (codes[R, n] uint8, scales[R] float32)."""
    x = x.astype(mx.float32)
    live, inv, scale = row_scale(x)
    codes = mx.where(live[:, None], enc(x * inv[:, None]), mx.array(0, mx.uint8))
    return codes, scale


def decode(codes: mx.array, scales: mx.array) -> mx.array:
    """codes[R, n] uint8, scales[R] -> float32 rows (table value times the row scale)."""
    return _TABLE[codes] * scales.astype(mx.float32)[..., None]


def table() -> mx.array:
    """The 256-entry float32 decode table (0x7F/0xFF -> 0)."""
    return _TABLE

