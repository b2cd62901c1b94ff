"""Expert parallelism inside one worker: the experts it holds, and the MoE provider that
computes those and sends the other picks to their owners.

Ownership is a table per MoE layer, `owners[layer]` = int32[E] worker rank of each routed
expert (from cluster.planner.split_experts; every expert has exactly one owner). A worker
holds only its own experts: the loader reads just those tensors (workers.weights.load_params
with `experts=`), so the others never enter its memory; experts gained after a peer's death
are read from the checkpoint by name (`read_experts`).

Where the shard lives: a cuda worker running the CuPy model keeps the experts the budget
plan pins (cluster/planner.py, carried by cluster.placement.split_owners) on its GPU and
computes them there, on the model's device activations (only the rows of picks that go to
peers or to host experts are downloaded), and its other experts in host memory, computed
with numpy (`SplitShard`); metal and cpu workers, and a cuda worker that fell back to the
numpy model, keep all of theirs in host memory and compute them with numpy. The host parts
run workers.moe.grouped_expert_sum (one expert at a time); the GPU parts its bucketed form,
workers.moe.batched_expert_sum (a bucket of experts per batched GEMM), which adds a token's
outputs in the same order.

Counters (per worker, since start), for the soak and the dashboards:
  expert_pins   routed experts held; expert_bytes their stacks' bytes (float32)
  expert_pins_device, expert_pins_host   of those, held on the GPU / in host memory
  expert_bytes_device   bytes of the GPU stacks (what the plan's pinned bytes must match)
  expert_device where the shard computes: "cuda" (the worker's GPU: device activations in
                and out) or "host"
  host_picks    picks (its own and its peers') computed from host memory, by numpy
  local_picks   routed (token, expert) picks of this worker's own tokens served by its shard
  remote_picks  picks of its own tokens sent to a peer
  served_picks  picks of peers' tokens this worker computed for them
  hit rate      local_picks / (local_picks + remote_picks): the share of this worker's
                routed picks that stayed on the worker (1.0 on a single worker or replicas).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any

import numpy as np

from workers import cuda_model
from workers.config import ModelConfig
from workers.moe import batched_expert_sum, gated_mlp, grouped_expert_sum
from workers.transport import ExpertTransport
from workers.weights import name_table, open_checkpoint

PARTS = ("gate", "up", "down")


class ExpertShard:
    """Stacked weights of the routed experts one worker holds, per MoE layer, as float32
    arrays of module `xp`: numpy (host memory; gate [n, I, H], up [n, I, H], down [n, H, I])
    or cupy (the GPU that is current when the shard is made: a cuda worker running
    workers.cuda_model.CudaModel; gate and up stacked as gate_up [n, 2I, H], CudaModel's
    layout, so an expert's two projections are one GEMM). Host arrays given to put / add are
    uploaded there, once. A layer's entry is replaced whole (one tuple), so a peer's call
    running in another thread always sees a consistent (row map, weights) pair."""

    def __init__(self, n_experts: int, xp: Any = np):
        self.n_experts, self.xp = n_experts, xp
        self.on_gpu = xp is not np
        self.device = "cuda" if self.on_gpu else "host"  # where the stacks live (counters)
        self._gpu = xp.cuda.Device().id if self.on_gpu else None
        self._layers: dict[int, tuple] = {}  # layer -> (ids, row_of, stacks)

    def on_device(self):
        """Context for work on the shard's arrays from any thread: its GPU made current
        (a thread's current device is its own), nothing on the host."""
        return self.xp.cuda.Device(self._gpu) if self.on_gpu else contextlib.nullcontext()

    def to_host(self, a):
        return a.get() if self.on_gpu else a

    def _stacks(self, gate, up, down) -> tuple:
        """Host or device gate/up/down of n experts -> this shard's stacks (see the class)."""
        if not self.on_gpu:
            return gate, up, down
        xp, f32 = self.xp, np.float32
        return (xp.concatenate([xp.asarray(gate, f32), xp.asarray(up, f32)], axis=1),
                xp.asarray(down, f32))

    def put(self, layer: int, ids: np.ndarray, gate, up, down) -> None:
        """Hold exactly experts `ids` of `layer` (rows of gate/up/down in that order)."""
        with self.on_device():
            self.put_stacks(layer, ids, self._stacks(gate, up, down))

    def put_stacks(self, layer: int, ids: np.ndarray, stacks: tuple) -> None:
        """put, with the stacks already in this shard's layout and module (e.g. CudaModel's
        device gate_up / down, taken over as they are)."""
        ids = np.asarray(ids, np.int64)
        row_of = np.full(self.n_experts, -1, np.int64)
        row_of[ids] = np.arange(len(ids))
        if self.on_gpu:  # complete before a peer's call on another thread (stream) reads them
            self.xp.cuda.Device(self._gpu).synchronize()
        self._layers[layer] = (ids, row_of, tuple(stacks))

    def add(self, layer: int, ids: np.ndarray, gate, up, down, pinned=None) -> None:
        """Append experts `ids` (e.g. gained by reassign). pinned: unused here, a one-part
        shard keeps every expert in its module (SplitShard.add places them by it)."""
        old = self._layers.get(layer)
        if old is None:
            self.put(layer, ids, gate, up, down)
            return
        with self.on_device():
            self.put_stacks(layer, np.concatenate([old[0], ids]),
                            [self.xp.concatenate([a, b]) for a, b in
                             zip(old[2], self._stacks(gate, up, down))])

    def ids(self, layer: int) -> np.ndarray:
        entry = self._layers.get(layer)
        return np.zeros(0, np.int64) if entry is None else entry[0]

    def count(self) -> int:
        return int(sum(len(e[0]) for e in self._layers.values()))

    def nbytes(self) -> int:
        return int(sum(a.nbytes for e in self._layers.values() for a in e[2]))

    def parts(self) -> tuple[ExpertShard, ...]:
        return (self,)

    def rows(self, layer: int, idx: np.ndarray) -> np.ndarray:
        """Row of each pick's expert in this shard's stacks of `layer`; -1 for picks < 0 and
        for experts not held here."""
        entry = self._layers.get(layer)
        return _rows(None if entry is None else entry[1], idx)

    def host_picks(self, layer: int, idx: np.ndarray) -> int:
        """How many of the picks idx >= 0 this shard computes from host memory."""
        return 0 if self.on_gpu else int((np.asarray(idx) >= 0).sum())

    def compute(self, layer: int, x, idx: np.ndarray, w: np.ndarray):
        """sum over the picks idx >= 0 of w * expert(x); every such expert must be held here.
        x [N, hidden] and the result are arrays of the shard's module, idx / w host [N, k]."""
        entry = self._layers.get(layer)
        picked = idx >= 0
        if entry is None:
            if picked.any():
                raise KeyError(f"layer {layer}: experts {np.unique(idx[picked]).tolist()} are not held here")
            with self.on_device():
                return self.xp.zeros_like(x)
        ids, row_of, stacks = entry
        rows = _rows(row_of, idx)
        missing = picked & (rows < 0)
        if missing.any():
            raise KeyError(f"layer {layer}: experts {np.unique(idx[missing]).tolist()} are not "
                           f"held here (held: {ids.tolist()})")
        if self.on_gpu:
            gate_up, down = stacks
            with self.on_device():  # (a bucket of experts per batched GEMM: see batched_expert_sum)
                return batched_expert_sum(
                    x, rows, w, lambda e, xs: cuda_model.batched_gated_mlp(e, xs, gate_up, down),
                    self.xp)
        gate, up, down = stacks
        return grouped_expert_sum(x, rows, w, lambda e, r: gated_mlp(r, gate[e], up[e], down[e]))


def _rows(row_of: np.ndarray | None, idx: np.ndarray) -> np.ndarray:
    idx = np.asarray(idx)
    if row_of is None:
        return np.full(idx.shape, -1, np.int64)
    picked = idx >= 0
    return np.where(picked, row_of[np.where(picked, idx, 0)], -1)


class SplitShard:
    """A cuda worker's shard: the experts the plan pins in `dev` (a cupy ExpertShard on its
    GPU), the others in `host` (a numpy ExpertShard: float32 in host memory, what the plan
    serves from host memory). compute sends each pick to the part that holds its expert: the
    rows of picks that go to host experts are downloaded, computed with numpy, and their
    result uploaded and added onto the device part's. Both parts run grouped_expert_sum;
    the total differs from one shard's only in the order of a token's float32 additions
    (device picks summed, then host picks added). Otherwise it is the device part as
    ShardedExperts sees it (module, device, on_device, to_host), so apply and a peer's serve
    use it as they use one shard. (With xp numpy for both parts it runs on any host: tests.)"""

    def __init__(self, dev: ExpertShard, host: ExpertShard):
        if host.on_gpu or dev.n_experts != host.n_experts:
            raise ValueError(f"SplitShard needs a host part of numpy and the same n_experts, got "
                             f"host on {host.device}, n_experts {dev.n_experts} / {host.n_experts}")
        self.dev, self.host = dev, host
        self.n_experts, self.xp, self.on_gpu, self.device = dev.n_experts, dev.xp, dev.on_gpu, dev.device
        self.on_device, self.to_host = dev.on_device, dev.to_host

    def parts(self) -> tuple[ExpertShard, ...]:
        return (self.dev, self.host)

    def add(self, layer: int, ids: np.ndarray, gate, up, down, pinned=None) -> None:
        """Append experts `ids`: those with `pinned` (bool per id; None: all) to the device
        part, the others to the host part."""
        ids = np.asarray(ids, np.int64)
        pinned = np.ones(len(ids), bool) if pinned is None else np.asarray(pinned, bool)
        if pinned.shape != ids.shape:
            raise ValueError(f"layer {layer}: pinned has shape {pinned.shape}, ids {ids.shape}")
        for part, keep in ((self.dev, pinned), (self.host, ~pinned)):
            if keep.any():
                part.add(layer, ids[keep], gate[keep], up[keep], down[keep])

    def ids(self, layer: int) -> np.ndarray:
        return np.concatenate([self.dev.ids(layer), self.host.ids(layer)])

    def count(self) -> int:
        return self.dev.count() + self.host.count()

    def nbytes(self) -> int:
        return self.dev.nbytes() + self.host.nbytes()

    def host_picks(self, layer: int, idx: np.ndarray) -> int:
        return int((self.host.rows(layer, idx) >= 0).sum())

    def compute(self, layer: int, x, idx: np.ndarray, w: np.ndarray):
        """ExpertShard.compute over both parts: x [N, hidden] and the result arrays of the
        device part's module, idx / w host [N, k]."""
        idx = np.asarray(idx)
        on_host = self.host.rows(layer, idx) >= 0
        missing = (idx >= 0) & ~on_host & (self.dev.rows(layer, idx) < 0)
        if missing.any():
            raise KeyError(f"layer {layer}: experts {np.unique(idx[missing]).tolist()} are not held "
                           f"here (on the device: {self.dev.ids(layer).tolist()}, in host memory: "
                           f"{self.host.ids(layer).tolist()})")
        if not on_host.any():
            return self.dev.compute(layer, x, idx, w)
        dev, xp = self.dev, self.dev.xp
        rows = np.flatnonzero(on_host.any(axis=1))  # tokens with a host pick
        with dev.on_device():
            xs = dev.to_host(x[xp.asarray(rows)])
            out = dev.compute(layer, x, np.where(on_host, -1, idx), w)
            ys = self.host.compute(layer, xs, np.where(on_host[rows], idx[rows], -1),
                                   np.asarray(w, np.float32)[rows])
            out[xp.asarray(rows)] += xp.asarray(ys)
        return out


def take_shard(model: Any, cfg: ModelConfig, owned: dict[int, np.ndarray],
               host: dict[int, tuple] | None = None) -> ExpertShard | SplitShard:
    """Move the routed expert stacks out of a model loaded with `experts=owned` into the
    worker's shard, and add `host` ({layer: (ids, gate, up, down)}: experts of the worker
    not loaded with the model, e.g. read_experts' answer) in host memory. A CudaModel's
    device stacks (CudaModel.take_experts) go as they are (no copy, none left on the host)
    into the device part of a SplitShard on its GPU, `host` into its host part; a numpy
    Model's or MLXModel's (per-layer host dicts `model.layers[i].p`) and `host` into one
    numpy ExpertShard."""
    if isinstance(model, cuda_model.CudaModel):
        import cupy as cp
        dev = ExpertShard(cfg.n_routed_experts, cp)
        for layer, ids in owned.items():
            stacks = model.take_experts(layer)
            if len(ids):
                dev.put_stacks(layer, ids, stacks)
        shard = SplitShard(dev, ExpertShard(cfg.n_routed_experts))
        parts = shard.host
    else:
        shard = parts = ExpertShard(cfg.n_routed_experts)
        for layer, ids in owned.items():
            p = model.layers[layer].p
            stacks = [p.pop(f"experts.{name}", None) for name in PARTS]
            if len(ids):
                shard.put(layer, ids, *(np.array(s, np.float32) for s in stacks))
    for layer, (ids, gate, up, down) in (host or {}).items():
        parts.add(layer, ids, gate, up, down)
    return shard


def read_experts(model_dir, cfg: ModelConfig, wanted: dict[int, np.ndarray]) -> dict[int, tuple]:
    """{layer: (gate [n, I, H], up [n, I, H], down [n, H, I])} for the listed expert ids,
    read by name from the checkpoint (nothing else is read)."""
    refs = open_checkpoint(model_dir)
    want = {(int(l), int(j)): r for l, ids in wanted.items() for r, j in enumerate(np.asarray(ids).tolist())}
    out: dict[int, list[np.ndarray]] = {}
    for name, slot in name_table(cfg).items():
        if slot.index is None:
            continue
        layer = int(slot.param.split(".")[1])
        row = want.get((layer, slot.index))
        if row is None:
            continue
        part = PARTS.index(slot.param.rsplit(".", 1)[1])
        if layer not in out:
            n = len(wanted[layer])
            mi, H = cfg.moe_intermediate_size, cfg.hidden_size
            out[layer] = [np.empty((n, mi, H), np.float32), np.empty((n, mi, H), np.float32),
                          np.empty((n, H, mi), np.float32)]
        out[layer][part][row] = refs[name].read()
    return {l: tuple(v) for l, v in out.items()}


class ShardedExperts:
    """The MoE `experts` provider of one worker (rank `rank`): its own picks through its
    shard, the rest through the transport to their owners, summed per token."""

    def __init__(self, rank: int, owners: dict[int, np.ndarray], shard: ExpertShard | SplitShard,
                 transport: ExpertTransport | None = None):
        self.rank, self.shard, self.transport = rank, shard, transport
        self.owners = {int(l): np.asarray(o, np.int32) for l, o in owners.items()}
        self._lock = threading.Lock()  # counters: the step thread and peer-call threads
        self.local_picks = self.remote_picks = self.served_picks = self.host_picks = 0

    def apply(self, layer: int, x, idx: np.ndarray, w: np.ndarray):
        """x [N, hidden] and the result are arrays of the shard's module (a cuda worker's
        device activations stay there: only the rows sent to peers are downloaded, and their
        answers uploaded); idx, w host [N, k]."""
        sh = self.shard
        own = self.owners[layer][idx]  # [N, k] owner rank of each pick
        with sh.on_device():
            sent = {}
            for peer in np.unique(own).tolist():
                if peer == self.rank:
                    continue
                mask = own == peer
                rows = np.flatnonzero(mask.any(axis=1))
                sub = np.where(mask[rows], idx[rows], -1)
                xs = sh.to_host(x[sh.xp.asarray(rows)])
                sent[peer] = (rows, self.transport.submit(peer, layer, xs, sub, w[rows]))
            mine = own == self.rank
            ours = np.where(mine, idx, -1)
            out = sh.compute(layer, x, ours, w)  # overlaps the peers
            if sent:
                answers = self.transport.gather({p: h for p, (_, h) in sent.items()})
                for peer, (rows, _) in sent.items():
                    out[sh.xp.asarray(rows)] += sh.xp.asarray(answers[peer])
        n_local, n_host = int(mine.sum()), sh.host_picks(layer, ours)
        with self._lock:
            self.local_picks += n_local
            self.remote_picks += int(mine.size) - n_local
            self.host_picks += n_host
        return out

    def serve(self, layer: int, x: np.ndarray, idx: np.ndarray, w: np.ndarray) -> np.ndarray:
        """A peer's call (host arrays in and out, on a thread of the experts concurrency
        group): its rows, with -1 for picks that are not ours."""
        sh, idx = self.shard, np.asarray(idx)
        with sh.on_device():
            y = sh.to_host(sh.compute(layer, sh.xp.asarray(x, np.float32), idx,
                                      np.asarray(w, np.float32)))
        n_host = sh.host_picks(layer, idx)
        with self._lock:
            self.served_picks += int((idx >= 0).sum())
            self.host_picks += n_host
        return y

    @property
    def device(self) -> str:
        """Where the shard computes: "cuda" (device arrays in and out of apply) or "host"."""
        return self.shard.device

    def set_owners(self, owners: dict[int, np.ndarray]) -> None:
        self.owners = {int(l): np.asarray(o, np.int32) for l, o in owners.items()}

    def counters(self) -> dict[str, Any]:
        parts = self.shard.parts()
        gpu = [p for p in parts if p.on_gpu]
        with self._lock:
            total = self.local_picks + self.remote_picks
            return {"expert_pins": self.shard.count(), "expert_bytes": self.shard.nbytes(),
                    "expert_pins_device": sum(p.count() for p in gpu),
                    "expert_pins_host": sum(p.count() for p in parts if not p.on_gpu),
                    "expert_bytes_device": sum(p.nbytes() for p in gpu),
                    "expert_device": self.shard.device,
                    "local_picks": self.local_picks, "remote_picks": self.remote_picks,
                    "served_picks": self.served_picks, "host_picks": self.host_picks,
                    "expert_hit_rate": self.local_picks / total if total else None}
