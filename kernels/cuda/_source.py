"""The text of a kernels/cuda source with its local #include "x.cuh" lines replaced by the
headers' text, once each (no CuPy here: scripts/sm90_compile_check.py uses it too), so that
compile caches key on everything that is compiled."""
from __future__ import annotations

import functools
import os
import re

_HERE = os.path.dirname(os.path.abspath(__file__))
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


@functools.lru_cache(maxsize=None)
def _source(name: str) -> str:
    """kernels/cuda/`name` with its local headers inlined (see the module's docstring)."""
    return _expand(name, set())


def _expand(name: str, seen: set) -> str:
    with open(os.path.join(_HERE, name), encoding="utf-8") as f:
        lines = f.read().splitlines(keepends=True)
    out = []
    for line in lines:
        m = _INCLUDE.match(line)
        if m is None:
            out.append(line)
        elif m.group(1) not in seen:
            seen.add(m.group(1))
            out.append(_expand(m.group(1), seen))
    return "".join(out)
