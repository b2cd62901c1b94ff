"""Waiting for one lockstep step of several worker actors without letting a hung one hold
the group forever (cluster/ep_group.py ShardedGroup, workers/actor.py RayGroup).

`collect_steps` gets every step's result (an error as its value). A grace period starts
at the first failed step, or `timeout_s` after the steps were submitted, whichever comes
first. When it runs out, the
steps still running are checked with `silent` (a ping); those that do not answer get a
StepHung as their result, and the ones that answer are only slow and are waited for: with
`every_s`, checked again every so many seconds (a step can hang after a ping it answered).
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable


class StepHung(TimeoutError):
    """The result of a step that outlived the grace and whose worker did not answer."""


def no_ping(workers) -> dict[int, str]:
    """`silent` for actors that run one call at a time: a ping would queue behind the step
    itself, so every step still running counts as hung."""
    return {i: "its step still runs" for i in workers}


def collect_steps(ray, refs: dict[int, Any], names: dict[int, str], grace_s: float,
                  silent: Callable[[list[int]], dict[int, str]] = no_ping, *,
                  timeout_s: float | None = None, every_s: float | None = None) -> dict[int, Any]:
    """ray.get of every ref, under the grace rule of the module docstring (grace_s inf: no
    grace, the timeout alone; timeout_s None: none; every_s None: no check after the first)."""
    out: dict[int, Any] = {}
    pending = dict(refs)
    t0 = time.monotonic()
    deadline = None if timeout_s is None else t0 + timeout_s
    while pending:
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        ready, _ = ray.wait(list(pending.values()), num_returns=1, timeout=timeout)
        if not ready:
            hung = silent(list(pending))
            for i in hung:
                pending.pop(i)
                grace = (f"grace {grace_s:g} s after a failed step ended, "
                         if math.isfinite(grace_s) else "")
                watch = f"step timeout {timeout_s}" if every_s is None else f"checked every {every_s:g} s"
                out[i] = StepHung(f"worker {names[i]}: its step still runs after "
                                  f"{time.monotonic() - t0:.0f} s ({grace}{watch}) and it does "
                                  f"not answer a ping ({hung[i]})")
            # the ones that answered: slow, not hung (yet)
            deadline = None if every_s is None else time.monotonic() + every_s
            continue
        for i in [i for i, r in pending.items() if r in ready]:
            try:
                out[i] = ray.get(pending.pop(i))
                failed = False
            except ray.exceptions.RayError as e:
                out[i], failed = e, True
            if failed and pending and math.isfinite(grace_s):  # (inf: no grace)
                end = time.monotonic() + grace_s
                deadline = end if deadline is None else min(deadline, end)
    return out
