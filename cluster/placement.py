"""Where the workers of an expert-parallel job go, and which routed experts each one owns.

Placement (`fleet_placements`): one worker per fleet device. A device of kind K asks Ray for
its node's `resources` (split over the node's devices) or, when the fleet gives none,
`{"kvfleet_<K>": 1}`, plus the node's `labels` as a label selector; a cuda device adds
num_gpus=1 only together with those (Ray also counts Apple GPUs as GPUs). Without a fleet,
`workers.count` cpu workers with `workers.resources` / `label_selector` as given.

With a fleet, the devices are planned by cluster.fleet.plan_fleet as `kvfleet plan --as-job`
plans them (the job's kv, max_context and block_size, in whose whole blocks its workers'
pools hold each slot's context; no fp8 shadow, whatever the fleet's plan.shadow_floor_gb: a
cuda worker's pool is on its GPU and takes host rows in once), with the experts in
the format the job loads, workers.weights.EXPERT_FORMAT (bf16: the loader reads no int4 or
fp8 experts), whatever the fleet's plan.experts says (a warning says when it differs), and
with `loaded=True`: a cuda device's dense weights and pinned experts count the float32 its
CuPy worker uploads (twice bf16), so what the plan pins there fits the GPU (cpu and metal
devices as `kvfleet plan` counts them). `kvfleet plan --experts bf16 --as-job` prints that
plan.
A job `slots` that is set (YAML, KVFLEET_SLOTS, --slots) overrides every node's `slots`, as
`kvfleet plan --slots` does; left unset, each device gets its node's. `workers.count`, when
set, must equal the number of fleet devices (the fleet gives one worker per device). A
relative `workers.fleet` resolves against the repo root, as a relative `model` does.

Experts (`split_owners`): cluster.planner.split_experts over each device's room for experts
in the budget plan (free + pinned bytes), so every routed expert has exactly one owner:
dealt out evenly when an even share fits every device (cluster.planner.deal_evenly), else
most room first, as `kvfleet plan` shows it. The plan's pinned flag goes with it: a cuda
worker keeps its pinned experts on the GPU and the others in host memory
(workers/ep_worker.py), so its experts take no more device memory than its room.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from cluster.config import REPO_ROOT, JobConfig, JobConfigError
from workers.actor import WorkerSpec
from workers.weights import EXPERT_FORMAT

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from cluster.fleet import Fleet


@dataclass(frozen=True)
class Placement:
    spec: WorkerSpec
    kind: str  # cuda | cpu | metal
    options: dict[str, Any]  # Ray actor options
    expert_room: int  # bytes this worker may fill with routed experts (its plan's free + pinned)


def fleet_placements(cfg: JobConfig) -> list[Placement]:
    """One Placement per fleet device, or `workers.count` alike cpu workers without a fleet."""
    from cluster.footprint import Footprint
    w = cfg.workers
    if w.fleet is None:
        opts = _options("cpu", w.num_cpus, w.resources, w.label_selector, default_resource=False)
        return [Placement(_spec(cfg, f"worker{i}", cfg.slots), "cpu", opts, 1)
                for i in range(w.count)]
    from cluster.fleet import Fleet, FleetError, plan_fleet
    from cluster.memory_probe import free_bytes
    from cluster.planner import PlanError
    slots = cfg.slots if "slots" in cfg.model_fields_set else None  # None: each node's own
    try:
        fleet = Fleet.from_file(w.fleet if w.fleet.is_absolute() else REPO_ROOT / w.fleet)
        _check_count(cfg, fleet)
        fp = Footprint.from_file(cfg.model)
        if why := fp.tier_error(cfg.kv):  # (the workers' pools would refuse it, one traceback each)
            raise JobConfigError(f"kv={cfg.kv} (--kv, KVFLEET_KV, KV_TQ): {why} ({fp.config.source})")
        p = plan_fleet(fleet, fp, free_bytes,  # "auto": on the driver
                       tier=cfg.kv, ctx=cfg.max_context, experts=EXPERT_FORMAT, slots=slots,
                       loaded=True, block=cfg.block_size)
    except FleetError as e:  # also a failed probe of an "auto" device
        raise JobConfigError(f"workers.fleet: {e}") from None
    except PlanError as e:
        why = "" if slots is None else f" (the job's slots={slots} overrides every node's slots)"
        raise JobConfigError(f"workers.fleet {fleet.source}: {e}{why}") from None
    if fleet.plan.experts != EXPERT_FORMAT:
        log.warning("workers.fleet %s: plan.experts=%s, but the job loads %s experts (the checkpoint's; "
                    "workers/weights.py reads no %s experts): planned and split as %s, as `kvfleet plan "
                    "--experts %s --as-job` shows", fleet.source, fleet.plan.experts, EXPERT_FORMAT,
                    fleet.plan.experts, EXPERT_FORMAT, EXPERT_FORMAT)
    out = []
    for dev, dp in zip(fleet.devices(), p.devices):
        n = dev.node
        res = {k: v / n.devices for k, v in n.resources.items()}
        out.append(Placement(_spec(cfg, dev.name, dp.device.slots), n.kind,
                             _options(n.kind, w.num_cpus, res, n.labels),
                             max(dp.free_bytes + dp.pinned_bytes, 1)))
    return out


def _check_count(cfg: JobConfig, fleet: Fleet) -> None:
    """A set `workers.count` (YAML, KVFLEET_WORKERS, --workers) must agree with the fleet."""
    w, n = cfg.workers, len(fleet.devices())
    if "count" in w.model_fields_set and w.count != n:
        raise JobConfigError(f"workers.count={w.count} but workers.fleet {fleet.source} gives one worker "
                             f"per device, {n} in all; drop workers.count (or --workers / KVFLEET_WORKERS) "
                             "or change the fleet's nodes.*.devices")


def _options(kind: str, num_cpus: float, resources: dict[str, float], labels: dict[str, str],
             default_resource: bool = True) -> dict[str, Any]:
    """Ray actor options; a fleet device with no resources of its own asks for kvfleet_<kind>."""
    opts: dict[str, Any] = {"num_cpus": num_cpus}
    if resources or default_resource:
        opts["resources"] = dict(resources) or {f"kvfleet_{kind}": 1.0}
    if labels:
        opts["label_selector"] = dict(labels)
    if kind == "cuda":
        opts["num_gpus"] = 1
    return opts


def _spec(cfg: JobConfig, name: str, slots: int) -> WorkerSpec:
    return WorkerSpec(name=name, model=cfg.model_ref(), tier=cfg.kv, slots=slots,
                      max_context=cfg.max_context, block_size=cfg.block_size,
                      kv_cache_dir=None if cfg.kv_cache_dir is None else str(cfg.kv_cache_dir),
                      kv_cache_format=cfg.kv_cache_format)


@dataclass(frozen=True)
class ExpertSplit:
    """The routed experts of a job's workers, as the budget plan splits and pins them."""
    owners: list[dict[int, np.ndarray]]  # per worker, one shared table {MoE layer: int32[E] owner rank}
    pinned: list[dict[int, np.ndarray]]  # per worker {MoE layer: bool[E]}: owned there and pinned
    expert_bytes: list[int]  # per worker: one routed expert's bytes in its room (device_bytes)


def split_owners(cfg: JobConfig, rooms: list[int], kinds: list[str], sharded: bool) -> ExpertSplit:
    """The owner table (every routed expert of a loaded MoE layer has exactly one owner) and
    which of each worker's experts the plan pins: those that fit its room (the plan's
    `pinned`), the rest it serves from host memory (workers/ep_worker.py). Replicated: every
    worker owns every expert (its own rank everywhere) and pins as many as fit its room, in
    the planner's order (spread over the layers). One expert takes the bytes the job's plan
    counts on the worker's kind (cluster.planner.device_bytes, loaded: float32 on cuda)."""
    from cluster.footprint import Footprint
    from cluster.planner import assign_experts, device_bytes, expert_order, split_experts
    fp = Footprint.from_file(cfg.model)
    E, layers = fp.config.n_routed_experts, fp.run_moe_layers
    eb = [device_bytes(fp, kind, EXPERT_FORMAT, loaded=True)[1] for kind in kinds]

    def table(fill, experts, values):
        out = {l: np.full(E, fill) for l in layers}
        for (l, e), v in zip(experts.tolist(), values.tolist()):
            out[l][e] = v
        return out
    if not sharded:
        order = expert_order(layers, E)
        pins = [assign_experts([room], b, order) for room, b in zip(rooms, eb)]
        return ExpertSplit([{l: np.full(E, r, np.int32) for l in layers} for r in range(len(rooms))],
                           [table(False, a.experts, a.pinned) for a in pins], eb)
    a = split_experts(fp, rooms, EXPERT_FORMAT, expert_bytes=eb)
    owners = {l: o.astype(np.int32) for l, o in table(-1, a.experts, a.owner).items()}
    pinned = [table(False, a.experts, a.pinned & (a.owner == r)) for r in range(len(rooms))]
    return ExpertSplit([owners] * len(rooms), pinned, eb)
