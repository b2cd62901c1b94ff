"""Free memory of a device, for fleet nodes whose memory is "auto", read on THIS machine.

cuda: cudaMemGetInfo through CuPy, else `nvidia-smi --query-gpu=memory.free`, of the local
GPU with the device's index. cpu / metal: available host memory (psutil when installed,
else /proc/meminfo on Linux); a Mac's GPU shares that memory. A cpu node's devices (memory
domains, one worker each) share the one host, so each gets an even share of it: measured
whole per device, a `devices: 2` node was planned on twice the memory the host has.

Nothing runs on the fleet's nodes: `kvfleet plan` probes where it runs and the generate job
probes on its driver, whichever node a device belongs to. So "auto" measures the node the
planner runs on (a one-machine fleet, or the driver's own node); give other nodes' memory
in GB (or `kvfleet plan --free-gb DEVICE=GB`).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # cluster.fleet imports ProbeError from here
    from cluster.fleet import DeviceSpec


class ProbeError(RuntimeError):
    """Free memory could not be read: says which device and what was tried."""


def free_bytes(spec: DeviceSpec) -> int:
    if spec.node.kind == "cuda":
        return _cuda_free(spec.index)
    return host_available() // spec.node.devices  # (metal: devices is 1)


def _cuda_free(index: int) -> int:
    if importlib.util.find_spec("cupy") is not None:
        import cupy
        with cupy.cuda.Device(index):
            return int(cupy.cuda.runtime.memGetInfo()[0])
    smi = shutil.which("nvidia-smi")
    if smi is None:
        raise ProbeError(f"cuda device {index}: neither cupy nor nvidia-smi is available to read free memory")
    out = subprocess.run([smi, f"--id={smi_id(index)}", "--query-gpu=memory.free",
                          "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0 or not out.stdout.strip().isdigit():
        raise ProbeError(f"cuda device {index}: nvidia-smi failed ({out.returncode}): {out.stderr.strip() or out.stdout.strip()}")
    return int(out.stdout.strip()) * 2**20  # MiB


def smi_id(index: int, env: dict[str, str] | None = None) -> str:
    """nvidia-smi's --id for CUDA device `index` as CuPy numbers it: nvidia-smi ignores
    CUDA_VISIBLE_DEVICES, so a logical index goes through that list (entries are physical
    indices or GPU UUIDs; nvidia-smi takes either). Set but empty, it shows no device, as
    CUDA reads it."""
    visible = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return str(index)
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if not 0 <= index < len(ids):
        raise ProbeError(f"cuda device {index}: CUDA_VISIBLE_DEVICES={visible!r} shows "
                         f"{len(ids)} device(s)")
    return ids[index]


def host_available() -> int:
    if importlib.util.find_spec("psutil") is not None:
        import psutil
        return int(psutil.virtual_memory().available)
    meminfo = Path("/proc/meminfo")
    if sys.platform.startswith("linux") and meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise ProbeError("host memory: psutil is not installed and /proc/meminfo has no MemAvailable")
