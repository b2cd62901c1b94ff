"""Is the Metal backend on, which MLX device runs it, how much memory a `metal` worker has,
and how often a kernel fell back from a hand-written Metal kernel to the MLX-op path.

    metal_enabled(env)   Metal present and not opted out (KVFLEET_METAL=0 or COLI_METAL=0)
    device(env)          mx.gpu when metal_enabled, else mx.cpu (the MLX CPU backend)
    memory_budget()      bytes a `metal` worker may plan with (see the function)
    KernelStats          per-pool/per-model counters: native Metal launches and fallbacks

The counters live on an object that the MLX pool and model own (never a module global), so
several engines in one Ray process keep separate counts; the first fallback of each kind on
each object is logged with its reason (INFO for the MLX-op path, WARNING for the numpy one).
"""
from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass, field

import mlx.core as mx

log = logging.getLogger(__name__)

OPT_OUT_VARS = ("KVFLEET_METAL", "COLI_METAL")
_OFF = {"0", "false", "no", "off"}


def opted_out(env=None) -> bool:
    """True when KVFLEET_METAL or COLI_METAL is set to 0/false/no/off."""
    env = os.environ if env is None else env
    return any(env.get(k, "").strip().lower() in _OFF for k in OPT_OUT_VARS)


def metal_available() -> bool:
    """MLX reports a Metal GPU (Apple silicon). False on Linux, where MLX runs on the CPU."""
    return bool(mx.metal.is_available())


def metal_enabled(env=None) -> bool:
    """The Metal backend is on by default where Metal exists, unless opted out."""
    return metal_available() and not opted_out(env)


def device(env=None) -> mx.Device:
    """The MLX device a `metal` worker computes on."""
    return mx.gpu if metal_enabled(env) else mx.cpu


def memory_budget() -> int:
    """Bytes of memory a `metal` worker plans with: the machine's RAM, since on Apple silicon
    the GPU shares it (unified memory). On a Mac this is MLX's device_info()["memory_size"]
    (the physical RAM); MLX's "max_recommended_working_set_size" (Metal's
    recommendedMaxWorkingSetSize, about 3/4 of RAM) is what the GPU can keep resident, so
    the smaller of the two is returned. Elsewhere (the MLX CPU backend on Linux) it is
    physical pages times page size from os.sysconf. The planner subtracts its reserve."""
    if metal_available():
        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        total = int(info["memory_size"])
        rec = int(info.get("max_recommended_working_set_size", total))
        return min(total, rec)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass
class KernelStats:
    """Launch counters of one pool or model: `native[name]` counts hand-written Metal kernel
    launches, `fallback[name]` counts calls served by a slower path instead (the MLX-op
    path, or for the polar tiers the numpy reference). The first fallback of each name is
    logged with its reason: at INFO by default (the MLX-op path, which every call takes
    where there is no Metal), at the level the caller gives for the numpy paths (WARNING)."""
    native: Counter = field(default_factory=Counter)
    fallback: Counter = field(default_factory=Counter)
    _since_drain: Counter = field(default_factory=Counter)

    def count_native(self, kernel: str) -> None:
        self.native[kernel] += 1

    def count_fallback(self, kernel: str, reason: str, level: int = logging.INFO) -> None:
        if not self.fallback[kernel]:
            log.log(level, "metal: %s falls back (%s); its further fallbacks are only counted",
                    kernel, reason)
        self.fallback[kernel] += 1
        self._since_drain[kernel] += 1

    def fallback_count(self) -> int:
        """Total fallbacks, all kernels together (what the metrics export)."""
        return sum(self.fallback.values())

    def drain_fallbacks(self) -> dict[str, int]:
        """Fallbacks per kernel since the previous drain (what a worker step reports)."""
        out, self._since_drain = dict(self._since_drain), Counter()
        return out

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {"native": dict(self.native), "fallback": dict(self.fallback)}
