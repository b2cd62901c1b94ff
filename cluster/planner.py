"""The budget planner: what each device holds, and which routed experts it pins.

Every device (one Ray worker) holds the dense weights, the KV pool of its slots, the DSA
indexer rows of those slots, an fp8 shadow (CUDA only, C engine's plan only, see below) and
as many routed experts as still fit; experts no device pins are served from host memory.
Bytes are exact integers; "GB" in configs and output means 1e9 bytes (the C engine's table
does the same).

    capacity = memory - reserve        (memory = the device's size, or its free memory for "auto")
    used     = dense + kv_pool + index + shadow + pinned experts  <=  capacity

For an "auto" device that is the design's budget: free memory minus the reserve minus the
shadow projection is what the dense weights, the pool and the pinned experts may use.
`host_experts` of a device counts the experts no device of the fleet pins.

Host memory of the kvfleet job (`host_bytes`, reported, never planned against): its workers
hold what workers/weights.py loads, float32 (twice a bf16 checkpoint), in numpy: on a cpu
or metal device every routed expert its worker owns in the split below (pinned or not:
workers/expert_shard.py computes those on the host), on a cuda device the experts its
worker owns and the split does not pin (they are served from host memory; the pinned ones
and the dense weights live on the GPU, none of them kept on the host once loaded), and on a
cpu device the dense weights too (a metal worker keeps its dense weights in MLX's copy).
The budget above counts weights in the checkpoint's format, as the C engine stores them, so
a cpu device whose float32 host figure and KV exceed its budget gets a warning, and so does a
metal device whose host figure, float32 dense weights (MLX's copy: on a Mac the same unified
memory its budget is) and KV do.

The job's own plan (`loaded=True`: cluster/placement.py) counts a cuda device's dense
weights and pinned experts as its CuPy worker holds them, the float32 arrays of
workers/weights.py (loaded_bytes: twice bf16), so the experts it pins fit the device memory
it really has; cpu and metal devices are counted as above. `kvfleet plan` keeps the
checkpoint's format everywhere (the C engine's table). The job's plan also counts the KV
pool its workers allocate (KVPool.for_model / DevicePool): the main layers' rows, not the
MTP layers' (it runs none; the C engine caches them), and no DSA indexer rows (a kvfleet job
computes no indexer: workers/weights.py skips its tensors). It sets aside no shadow
(`shadow_token_bytes`): a kvfleet cuda worker's KV pool is itself in device memory
(kvstore/device_pool.py DevicePool), and rows made on the host (numpy rows, rows read from
disk) are uploaded into it once, when written; there is no other device copy of them, so
a shadow beside the pool would count the same rows twice (on GLM-5.2 at 64k tokens, 2.99 GB
of an H200: 19 float32 experts it can pin).

Shadow (`kvfleet plan`, the C engine's table): the device copy of rows produced on the host
(prefill on the host, rows read from disk), kept as fp8 (kv8 layout) whatever the pool
tier. Projected for the worst case, every row of every slot: slots x ctx x cached layers x
kv8 token bytes. (Here and in the pool, ctx is counted in whole blocks, as the pool
allocates them: KVPool.for_model gives each slot ceil(ctx / block_size) blocks of
block_size tokens, so 2048 tokens in 1500-token blocks hold 3000. The job's plan uses its
block_size; `kvfleet plan`, BLOCK, the job's default, unless --block-size.) A CUDA device
smaller than SHADOW_FLOOR_GB gets none: on a 24 GB card the shadow of a single 128k GLM-5 slot
(6 GB) is a quarter of memory, better spent on the pool and pinned experts; such a device
uploads host rows straight into its pool. CPU and Metal devices read host memory directly.

Experts are placed by `split_experts` (also the runtime's expert-parallel split): when an
even share of them fits every device, dealt out round-robin (the same expert compute on
every worker, whatever their KV sizes); otherwise most used first (or spread evenly over
the MoE layers when no counts are given), each into the worker with the biggest free budget.
One expert's bytes may differ per device (the job's plan: float32 on cuda, bf16 elsewhere).
Only the experts a kvfleet job loads are placed, those of the main layers
(Footprint.run_moe_layers): the MTP layers' experts, which it never loads, would take room
(and, unpinned, count as served from host memory) that experts it runs could have.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from cluster.footprint import Footprint, WeightFormat, get_format
from kernels.tiers import Tier, get_tier
from workers.weights import PARAM_DTYPE, loaded_bytes

GB = 10**9
SHADOW_FLOOR_GB = 32.0
SHADOW_TIER = "kv8"
BLOCK = 16  # default pool block size (JobConfig.block_size): a slot holds whole blocks
KINDS = ("cuda", "cpu", "metal")


class PlanError(ValueError):
    """A plan that cannot be made: names the device, what it needs and its budget."""


def gb(n: int) -> str:
    return f"{n / GB:.2f} GB"


@dataclass(frozen=True)
class DeviceBudget:
    """One device as the planner sees it. memory_bytes: its size, or its free memory when auto."""
    name: str
    kind: str
    memory_bytes: int
    reserve_bytes: int = 0
    slots: int = 1
    auto: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise PlanError(f"device {self.name}: kind={self.kind!r} must be one of {KINDS}")
        if self.slots < 1 or self.memory_bytes < 0 or self.reserve_bytes < 0:
            raise PlanError(f"device {self.name}: slots={self.slots}, memory={self.memory_bytes}, "
                            f"reserve={self.reserve_bytes} must be >= 1, >= 0, >= 0")

    @property
    def capacity(self) -> int:
        return self.memory_bytes - self.reserve_bytes

    def has_shadow(self, floor_bytes: int) -> bool:
        return self.kind == "cuda" and self.memory_bytes >= floor_bytes


@dataclass(frozen=True)
class ExpertAssignment:
    """Each routed expert (layer, expert) -> exactly one worker; `pinned` = fits its budget."""
    experts: np.ndarray  # [N, 2] int32 (layer, expert), in placement order
    owner: np.ndarray    # [N] int32 worker index
    pinned: np.ndarray   # [N] bool
    even: bool = False   # dealt out round-robin (deal_evenly): an even share fitted every worker

    def shard(self, worker: int, pinned_only: bool = False) -> np.ndarray:
        keep = self.owner == worker
        if pinned_only:
            keep &= self.pinned
        return self.experts[keep]


def expert_order(moe_layers: Sequence[int], n_experts: int, usage: np.ndarray | None = None) -> np.ndarray:
    """All (layer, expert) pairs, most used first. usage: [len(moe_layers), n_experts] counts.

    Without usage (and among equal counts) the order is round-robin over layers: expert 0 of
    every MoE layer, then expert 1, ..., so any prefix is spread evenly across layers.
    """
    layers = np.asarray(moe_layers, dtype=np.int32)
    n_l = len(layers)
    li, ei = np.meshgrid(np.arange(n_l), np.arange(n_experts), indexing="ij")  # [n_l, E]
    spread = (ei * n_l + li).ravel()
    if usage is None:
        order = np.argsort(spread, kind="stable")
    else:
        usage = np.asarray(usage, dtype=np.float64)
        if why := _counts_error(usage, [(n_l, n_experts)]):
            raise PlanError(why)
        order = np.lexsort((spread, -usage.ravel()))
    return np.stack([layers[li.ravel()[order]], ei.ravel()[order].astype(np.int32)], axis=1)


def usage_error(fp: Footprint, usage: np.ndarray) -> str | None:
    """Why `usage` cannot be the expert usage counts of `fp` (split_experts takes them), else
    None: a row per MoE layer the job runs, or per MoE layer of the checkpoint (MTP ones
    too), a column per routed expert; finite counts >= 0."""
    e = fp.config.n_routed_experts
    return _counts_error(np.asarray(usage, dtype=np.float64),
                         list(dict.fromkeys([(len(fp.run_moe_layers), e), (len(fp.moe_layers), e)])))


def _counts_error(usage: np.ndarray, shapes: list[tuple[int, int]]) -> str | None:
    if usage.shape not in shapes:
        return (f"expert usage counts must have shape {' or '.join(map(str, shapes))} (MoE "
                f"layers x routed experts), got shape {usage.shape}")
    bad = np.flatnonzero(~(np.isfinite(usage) & (usage >= 0)))  # (NaN fails both)
    if bad.size:
        row, col = np.unravel_index(bad[0], usage.shape)
        return (f"expert usage counts must be finite and >= 0, got {usage[row, col]} at row "
                f"{row}, expert {col} ({bad.size} such)")
    return None


def _per_worker(expert_bytes: int | Sequence[int], n: int) -> list[int]:
    """One expert's bytes on each of n workers (one int: the same on all)."""
    eb = [int(expert_bytes)] * n if np.ndim(expert_bytes) == 0 else [int(b) for b in expert_bytes]
    if not n or len(eb) != n or min(eb) <= 0:
        raise PlanError(f"need expert_bytes > 0 for each of at least one worker, got {expert_bytes=}, "
                        f"{n} workers")
    return eb


def assign_experts(capacities: Sequence[int], expert_bytes: int | Sequence[int],
                   experts: np.ndarray) -> ExpertAssignment:
    """Give every expert, in the given order, to the worker with the most free bytes left.

    An expert is pinned when that worker still has its `expert_bytes` (one for all, or one
    per worker) free; once none has, the rest keep going to the emptiest worker (its budget
    goes negative: it serves them from host memory), so every expert has exactly one owner.
    Ties go to the lower worker index.
    """
    eb = _per_worker(expert_bytes, len(capacities))
    heap = [(-int(c), w) for w, c in enumerate(capacities)]
    heapq.heapify(heap)
    n = len(experts)
    owner, pinned = np.empty(n, np.int32), np.zeros(n, bool)
    for i in range(n):  # O(N log W): tens of thousands of experts, a few ms
        neg, w = heap[0]
        owner[i], pinned[i] = w, -neg >= eb[w]
        heapq.heapreplace(heap, (neg + eb[w], w))
    return ExpertAssignment(np.asarray(experts, np.int32).reshape(n, 2), owner, pinned)


def deal_evenly(capacities: Sequence[int], expert_bytes: int | Sequence[int],
                experts: np.ndarray) -> ExpertAssignment | None:
    """Deal `experts` out round-robin, each worker its share n // W or, for the n % W workers
    with the most room (ties: lower index), one more, when every worker's share fits its
    capacity: the same expert compute on every worker whatever their KV sizes (without this,
    tiny experts would all go to the one worker with the least KV). None when a share does
    not fit; then `assign_experts` pins most room first."""
    w_n, n = len(capacities), len(experts)
    eb = _per_worker(expert_bytes, w_n)
    turn = sorted(range(w_n), key=lambda w: -int(capacities[w]))  # (stable: ties keep index order)
    q, r = divmod(n, w_n)
    if any(int(capacities[w]) < (q + (i < r)) * eb[w] for i, w in enumerate(turn)):
        return None
    owner = np.asarray(turn, np.int32)[np.arange(n) % w_n]
    return ExpertAssignment(np.asarray(experts, np.int32).reshape(n, 2), owner, np.ones(n, bool), even=True)


def split_experts(fp: Footprint, capacities: Sequence[int], experts: str | WeightFormat = "bf16",
                  usage: np.ndarray | None = None,
                  expert_bytes: Sequence[int] | None = None) -> ExpertAssignment:
    """Expert-parallel split, the same for the plan and the runtime: every routed (layer,
    expert) of `fp` to exactly one of the workers, whose free bytes for experts are
    `capacities` (e.g. DevicePlan free_bytes + pinned_bytes of a plan). Dealt out evenly
    when an even share fits every worker (`deal_evenly`), else most used first into the
    biggest free budget (`assign_experts`). expert_bytes: one expert's bytes on each worker
    (device_bytes); None: fp.expert_bytes(experts) on all. Only the experts the job loads
    are split (fp.run_moe_layers); usage: counts per run MoE layer, or per MoE layer
    of the checkpoint, whose MTP rows (the last ones) are then left out."""
    run = fp.run_moe_layers
    if usage is not None and np.shape(usage)[:1] == (len(fp.moe_layers),) != (len(run),):
        usage = np.asarray(usage)[:len(run)]
    order = expert_order(run, fp.config.n_routed_experts, usage)
    eb = fp.expert_bytes(experts) if expert_bytes is None else list(expert_bytes)
    # dealt evenly every expert is pinned, so the order only decides who serves what: layer by
    # layer, so that every worker gets a share of every MoE layer, as vLLM's and SGLang's EP
    # splits do (dealing `order`, which cycles through the layers, gave each worker whole
    # layers: all of layer w to worker w when there are as many layers as workers)
    even = deal_evenly(capacities, eb, order[np.lexsort((order[:, 1], order[:, 0]))])
    return even if even is not None else assign_experts(capacities, eb, order)


@dataclass(frozen=True)
class DevicePlan:
    device: DeviceBudget
    ctx: int
    dense_bytes: int
    kv_pool_bytes: int
    index_bytes: int
    shadow_bytes: int
    pinned: np.ndarray = field(repr=False)  # [n, 2] (layer, expert)
    pinned_bytes: int
    host_experts: int  # routed experts no device pins (served from host memory)
    max_ctx: dict[str, int]
    host_bytes: int  # host RAM a kvfleet job's worker holds here: float32 weights (see above)

    @property
    def used_bytes(self) -> int:
        return self.dense_bytes + self.kv_pool_bytes + self.index_bytes + self.shadow_bytes + self.pinned_bytes

    @property
    def free_bytes(self) -> int:
        return self.device.capacity - self.used_bytes

    def to_dict(self, layers: Sequence[int]) -> dict:
        d = self.device
        per_layer = np.zeros(len(layers), np.int64)
        if len(self.pinned):
            idx = np.searchsorted(np.asarray(layers), self.pinned[:, 0])
            per_layer = np.bincount(idx, minlength=len(layers))
        return {
            "name": d.name, "kind": d.kind, "auto": d.auto, "memory_bytes": d.memory_bytes,
            "reserve_bytes": d.reserve_bytes, "budget_bytes": d.capacity, "slots": d.slots,
            "ctx": self.ctx, "dense_bytes": self.dense_bytes, "kv_pool_bytes": self.kv_pool_bytes,
            "index_bytes": self.index_bytes, "shadow_bytes": self.shadow_bytes,
            "pinned_experts": int(len(self.pinned)), "pinned_expert_bytes": self.pinned_bytes,
            "pinned_per_layer": {int(l): int(c) for l, c in zip(layers, per_layer)},
            "host_experts": self.host_experts, "free_bytes": self.free_bytes,
            "host_bytes": self.host_bytes,
            "max_ctx": dict(self.max_ctx),
        }


@dataclass(frozen=True)
class Plan:
    footprint: Footprint
    tier: Tier
    ctx: int
    expert_format: WeightFormat
    expert_bytes: int
    devices: tuple[DevicePlan, ...]
    host: np.ndarray = field(repr=False)  # [n, 2] experts pinned nowhere
    experts_even: bool = False  # an even share fitted every device: dealt out round-robin
    block: int = BLOCK  # tokens per pool block: each slot's ctx is counted in whole blocks
    loaded: bool = False  # planned as a kvfleet job holds it (plan's `loaded`)
    shadow_floor: int = int(SHADOW_FLOOR_GB * GB)  # a cuda device this big gets a shadow (not loaded)

    @property
    def warnings(self) -> list[str]:
        limit = self.footprint.config.max_position_embeddings
        out = [f"ctx {self.ctx} exceeds the model's max_position_embeddings {limit}"] if self.ctx > limit else []
        mlx_dense = loaded_bytes(self.footprint.config)[0]
        for d in self.devices:
            # a metal device's budget is the Mac's one unified memory (or, on MLX's CPU
            # backend, host RAM): its worker's host experts and MLX's float32 dense copy share it
            held = d.host_bytes + (mlx_dense if d.device.kind == "metal" else 0)
            need = held + d.kv_pool_bytes + d.index_bytes
            if d.device.kind in ("cpu", "metal") and need > d.device.capacity:
                out.append(f"device {d.device.name}: a kvfleet job holds its weights as float32 "
                           f"({gb(held)}{' with the dense weights MLX holds' if d.device.kind == 'metal' else ''}, "
                           f"the plan counts {self.expert_format.name} experts "
                           f"and bf16 dense weights) + KV {gb(d.kv_pool_bytes + d.index_bytes)}, "
                           f"over its budget {gb(d.device.capacity)}")
        return out

    def to_dict(self) -> dict:
        fp, layers = self.footprint, self.footprint.run_moe_layers
        kv, index = token_bytes(fp, self.tier, self.loaded)
        return {
            "model": fp.config.source, "model_type": fp.config.model_type, "tier": self.tier.name,
            "ctx": self.ctx, "block_size": self.block, "expert_format": self.expert_format.name,
            "expert_bytes": self.expert_bytes,
            "cached_layers": fp.cached_layers, "moe_layers": len(layers),
            # the layers whose KV the plan counts: a kvfleet job's pool has no MTP layer
            "kv_layers": fp.config.num_hidden_layers if self.loaded else fp.cached_layers,
            # the shadow counted on cuda devices of at least the floor: the C engine's kv8
            # copy of host rows over kv_layers; none (null) in a kvfleet job's plan, whose
            # device pool takes those rows in itself (shadow_token_bytes)
            "shadow_tier": None if self.loaded else SHADOW_TIER,
            "shadow_floor_bytes": None if self.loaded else self.shadow_floor,
            # the experts planned (a job loads them); the MTP layers' are not
            "routed_experts": fp.run_experts, "mtp_experts": fp.routed_experts - fp.run_experts,
            "pinned_experts": int(sum(len(d.pinned) for d in self.devices)),
            "host_experts": int(len(self.host)), "experts_even": self.experts_even,
            "host_dtype": np.dtype(PARAM_DTYPE).name,
            "host_bytes": int(sum(d.host_bytes for d in self.devices)),
            "kv_bytes_per_token": kv, "index_bytes_per_token": index,
            "devices": [d.to_dict(layers) for d in self.devices],
            "warnings": self.warnings,
        }


def device_bytes(fp: Footprint, kind: str, experts: str | WeightFormat = "bf16",
                 loaded: bool = False) -> tuple[int, int]:
    """(dense weights, one routed expert) as a plan counts them on a device of `kind`: in
    the checkpoint's format (`experts` for the experts), as the C engine stores them; with
    `loaded` on a cuda device, what a kvfleet job's CuPy worker holds there: the float32
    arrays of workers/weights.py (loaded_bytes), uploaded as they are."""
    if loaded and kind == "cuda":
        return loaded_bytes(fp.config)
    return fp.dense_bytes, fp.expert_bytes(experts)


def token_bytes(fp: Footprint, tier: str | Tier, loaded: bool = False) -> tuple[int, int]:
    """(KV, DSA indexer) bytes per token of one slot: of every cached layer, as the C engine
    holds them; with `loaded`, as a kvfleet job's pool does (main layers, no indexer rows)."""
    if loaded:
        return fp.run_kv_bytes_per_token(tier), 0
    return fp.kv_bytes_per_token(tier), fp.index_bytes_per_token


def shadow_token_bytes(fp: Footprint, dev: DeviceBudget, floor: int, loaded: bool = False) -> int:
    """Shadow bytes per token of one slot on `dev`: the C engine's kv8 copy of host rows over
    its cached layers, on a cuda device of at least `floor` bytes; none with `loaded` (a
    kvfleet cuda worker's pool is on the device and takes host rows in once, when written:
    its kv_pool bytes are that copy, counted once)."""
    return 0 if loaded or not dev.has_shadow(floor) else fp.kv_bytes_per_token(SHADOW_TIER)


def _per_token(fp: Footprint, dev: DeviceBudget, tier: Tier, floor: int,
               loaded: bool = False) -> tuple[int, int, int]:
    """(kv, index, shadow) bytes per context token on this device, all its slots."""
    kv, index = token_bytes(fp, tier, loaded)
    shadow = shadow_token_bytes(fp, dev, floor, loaded)
    return dev.slots * kv, dev.slots * index, dev.slots * shadow


def max_context(fp: Footprint, dev: DeviceBudget, tier: str | Tier,
                shadow_floor_bytes: int = int(SHADOW_FLOOR_GB * GB), dense: int | None = None,
                block: int = BLOCK, loaded: bool = False) -> int:
    """Longest context (whole blocks of `block` tokens) every slot of `dev` could have under
    `tier`, no experts pinned; dense: the dense weights' bytes there (default fp.dense_bytes).
    loaded: the KV as a kvfleet job's pool holds it (token_bytes)."""
    room = dev.capacity - (fp.dense_bytes if dense is None else dense)
    per = sum(_per_token(fp, dev, get_tier(tier), shadow_floor_bytes, loaded))
    return 0 if room <= 0 else (room // per) // block * block


def plan(fp: Footprint, devices: Sequence[DeviceBudget], *, tier: str | Tier, ctx: int,
         experts: str | WeightFormat = "bf16", usage: np.ndarray | None = None,
         shadow_floor_bytes: int = int(SHADOW_FLOOR_GB * GB),
         report_tiers: Sequence[str] = ("f32", "kv8", "tq4"), loaded: bool = False,
         block: int = BLOCK) -> Plan:
    """Plan every device; raise PlanError when a device cannot hold its dense weights and KV.
    loaded: count cuda devices as a kvfleet job's workers hold them (device_bytes; see the
    module docstring). block: the pool's tokens per block (the job's block_size)."""
    tier, fmt = get_tier(tier), get_format(experts)
    if ctx < 1 or block < 1 or not devices:
        raise PlanError(f"need ctx >= 1, block >= 1 and at least one device, got {ctx=}, {block=}, "
                        f"{len(devices)} devices")
    if len({d.name for d in devices}) != len(devices):
        raise PlanError(f"device names must be unique: {[d.name for d in devices]}")
    if why := fp.tier_error(tier):  # (a plan the job's pool would refuse)
        raise PlanError(f"{fp.config.source}: {why}")
    # the longest context of each tier the pool takes at these widths (tq4 may not be one)
    report_tiers = [t for t in report_tiers if fp.tier_error(t) is None]
    eb = fp.expert_bytes(fmt)
    sizes = [device_bytes(fp, dev.kind, fmt, loaded) for dev in devices]  # (dense, expert) each
    fixed, rooms = [], []
    held = -(-ctx // block) * block  # (KVPool.for_model gives each slot ceil(ctx / block) blocks)
    for dev, (dense, _) in zip(devices, sizes):
        kv, idx, sh = (held * b for b in _per_token(fp, dev, tier, shadow_floor_bytes, loaded))
        if dev.capacity <= 0:  # (an "auto" device: a fleet file's sizes are checked when read)
            what = "free memory ('auto')" if dev.auto else "memory"
            raise PlanError(f"device {dev.name}: its {what} {gb(dev.memory_bytes)} is no more than its "
                            f"reserve {gb(dev.reserve_bytes)}: nothing is left for weights or KV (lower its "
                            "node's reserve_gb, or free memory there)")
        if dense > dev.capacity:
            raise PlanError(f"device {dev.name}: dense weights need {gb(dense)} but its budget is "
                            f"{gb(dev.capacity)} ({gb(dev.memory_bytes)} - reserve {gb(dev.reserve_bytes)})")
        if dense + kv + idx + sh > dev.capacity:
            longest = {t: max_context(fp, dev, t, shadow_floor_bytes, dense, block, loaded)
                       for t in report_tiers}
            raise PlanError(
                f"device {dev.name}: dense weights {gb(dense)} + {tier.name} KV pool {gb(kv)} + indexer "
                f"{gb(idx)} + shadow {gb(sh)} for {dev.slots} slot(s) x {ctx} tokens exceed its budget "
                f"{gb(dev.capacity)}; longest context per tier: {longest}")
        fixed.append((kv, idx, sh))
        rooms.append(dev.capacity - dense - kv - idx - sh)
    a = split_experts(fp, rooms, fmt, usage, expert_bytes=[e for _, e in sizes])
    host = a.experts[~a.pinned]
    dense_f32, expert_f32 = loaded_bytes(fp.config)
    on_host = [(a.owner == w) & (~a.pinned if dev.kind == "cuda" else True)
               for w, dev in enumerate(devices)]  # the routed experts each worker holds in RAM
    plans = tuple(
        DevicePlan(dev, ctx, dense, kv, idx, sh, a.shard(w, pinned_only=True),
                   int((a.pinned & (a.owner == w)).sum()) * e, len(host),
                   {t: max_context(fp, dev, t, shadow_floor_bytes, dense, block, loaded)
                    for t in report_tiers},
                   int(on_host[w].sum()) * expert_f32 + (dense_f32 if dev.kind == "cpu" else 0))
        for w, (dev, (dense, e), (kv, idx, sh)) in enumerate(zip(devices, sizes, fixed)))
    return Plan(fp, tier, ctx, fmt, eb, plans, host, a.even, block, loaded, shadow_floor_bytes)

