"""A three-node Ray cluster on this machine for the sharding and fault tests: two nodes that
advertise a fake `kvfleet_cuda` resource (and one fake GPU each), one `kvfleet_metal` node
whose worker runs the MLX model on MLX's CPU backend (a cpu worker when MLX is missing)."""
from __future__ import annotations

import importlib.util
import os
import warnings
from pathlib import Path

HAS_MLX = importlib.util.find_spec("mlx") is not None


def metal_kind() -> str:
    if not HAS_MLX:
        warnings.warn("mlx is not importable: the metal node's worker runs the numpy model")
        return "cpu"
    return "metal"


def fleet_yaml(path: Path, slots=(3, 2, 1), memory=(8, 8, 8)) -> Path:
    """cuda-a, cuda-b, mac: no `resources` given, so placement asks for kvfleet_<kind>."""
    kinds = ("cuda", "cuda", metal_kind())
    names = ("cuda-a", "cuda-b", "mac")
    lines = ["nodes:"]
    for name, kind, s, m in zip(names, kinds, slots, memory):
        res = " resources: {kvfleet_metal: 1}," if (name == "mac" and kind == "cpu") else ""
        lines.append(f"  - {{name: {name}, kind: {kind}, memory: {m}, reserve_gb: 1, slots: {s},{res}}}")
    path.write_text("\n".join(lines) + "\n")
    return path


def start_cluster():
    """(cluster, ray) with the driver connected; the head is one of the three nodes."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray
    from ray.cluster_utils import Cluster
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "num_gpus": 1, "resources": {"kvfleet_cuda": 1}, "include_dashboard": False})
    c.add_node(num_cpus=2, num_gpus=1, resources={"kvfleet_cuda": 1})
    c.add_node(num_cpus=2, resources={"kvfleet_metal": 1})
    ray.init(address=c.address)
    c.wait_for_nodes()
    return c, ray


def stop_cluster(c, ray) -> None:
    ray.shutdown()
    c.shutdown()
