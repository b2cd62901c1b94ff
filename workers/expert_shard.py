"""Expert parallelism inside one worker: the experts it holds, and the MoE provider that
computes those and sends the other picks to their owners.

Ownership is a table per MoE layer, `owners[layer]` = int32[E] worker rank of each routed
expert (from cluster.planner.split_experts; every expert has exactly one owner). A worker
holds only its own experts: the loader reads just those tensors (workers.weights.load_params
with `experts=`), so the others never enter its memory; experts gained after a peer's death
are read from the checkpoint by name (`read_experts`).

Counters (per worker, since start), for the soak and the dashboards:
  local_picks   routed (token, expert) picks of this worker's own tokens served by its shard
  remote_picks  picks of its own tokens sent to a peer
  served_picks  picks of peers' tokens this worker computed for them
  hit rate      local_picks / (local_picks + remote_picks): the share of this worker's
                routed picks that stayed on the worker (1.0 on a single worker or replicas).
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np

from workers.config import ModelConfig
from workers.moe import expert_sum
from workers.transport import ExpertTransport
from workers.weights import name_table, open_checkpoint

PARTS = ("gate", "up", "down")


class ExpertShard:
    """Stacked weights of the routed experts one worker holds, per MoE layer. A layer's
    entry is replaced whole (one tuple), so a peer's call running in another thread always
    sees a consistent (row map, weights) pair."""

    def __init__(self, n_experts: int):
        self.n_experts = n_experts
        self._layers: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}

    def put(self, layer: int, ids: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> None:
        """Hold exactly experts `ids` of `layer` (rows of gate/up/down in that order)."""
        ids = np.asarray(ids, np.int64)
        row_of = np.full(self.n_experts, -1, np.int64)
        row_of[ids] = np.arange(len(ids))
        self._layers[layer] = (ids, row_of, gate, up, down)

    def add(self, layer: int, ids: np.ndarray, gate, up, down) -> None:
        old = self._layers.get(layer)
        if old is None:
            self.put(layer, ids, gate, up, down)
            return
        self.put(layer, np.concatenate([old[0], ids]), *(np.concatenate([a, b]) for a, b in
                                                           zip(old[2:], (gate, up, down))))

    def ids(self, layer: int) -> np.ndarray:
        entry = self._layers.get(layer)
        return np.zeros(0, np.int64) if entry is None else entry[0]

    def count(self) -> int:
        return int(sum(len(e[0]) for e in self._layers.values()))

    def nbytes(self) -> int:
        return int(sum(a.nbytes for e in self._layers.values() for a in e[2:]))

    def compute(self, layer: int, x: np.ndarray, idx: np.ndarray, w: np.ndarray) -> np.ndarray:
        """sum over the picks idx >= 0 of w * expert(x); every such expert must be held here."""
        entry = self._layers.get(layer)
        picked = idx >= 0
        if entry is None:
            if picked.any():
                raise KeyError(f"layer {layer}: experts {np.unique(idx[picked]).tolist()} are not held here")
            return np.zeros_like(x)
        ids, row_of, gate, up, down = entry
        rows = np.where(picked, row_of[np.where(picked, idx, 0)], -1)
        missing = picked & (rows < 0)
        if missing.any():
            raise KeyError(f"layer {layer}: experts {np.unique(idx[missing]).tolist()} are not "
                           f"held here (held: {ids.tolist()})")
        return expert_sum(x, rows, w, gate, up, down)


def take_shard(model: Any, cfg: ModelConfig, owned: dict[int, np.ndarray]) -> ExpertShard:
    """Move the routed expert stacks out of a model loaded with `experts=owned` (numpy Model
    or MLXModel: both keep per-layer dicts `model.layers[i].p`) into a numpy ExpertShard."""
    shard = ExpertShard(cfg.n_routed_experts)
    for layer, ids in owned.items():
        p = model.layers[layer].p
        stacks = [p.pop(f"experts.{name}", None) for name in PARTS]
        if len(ids) == 0:
            continue
        shard.put(layer, ids, *(np.array(s, np.float32) for s in stacks))
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

    def __init__(self, rank: int, owners: dict[int, np.ndarray], shard: ExpertShard,
                 transport: ExpertTransport | None = None):
        self.rank, self.shard, self.transport = rank, shard, transport
        self.owners = {int(l): np.asarray(o, np.int32) for l, o in owners.items()}
        self._lock = threading.Lock()  # counters: the step thread and peer-call threads
        self.local_picks = self.remote_picks = self.served_picks = 0

    def apply(self, layer: int, x: np.ndarray, idx: np.ndarray, w: np.ndarray) -> np.ndarray:
        own = self.owners[layer][idx]  # [N, k] owner rank of each pick
        sent = {}
        for peer in np.unique(own).tolist():
            if peer == self.rank:
                continue
            mask = own == peer
            rows = np.flatnonzero(mask.any(axis=1))
            sub = np.where(mask[rows], idx[rows], -1)
            sent[peer] = (rows, self.transport.submit(peer, layer, x[rows], sub, w[rows]))
        mine = own == self.rank
        out = self.shard.compute(layer, x, np.where(mine, idx, -1), w)  # overlaps the peers
        if sent:
            answers = self.transport.gather({p: h for p, (_, h) in sent.items()})
            for peer, (rows, _) in sent.items():
                out[rows] += answers[peer]
        n_local = int(mine.sum())
        with self._lock:
            self.local_picks += n_local
            self.remote_picks += int(mine.size) - n_local
        return out

    def serve(self, layer: int, x: np.ndarray, idx: np.ndarray, w: np.ndarray) -> np.ndarray:
        """A peer's call: its rows, with -1 for picks that are not ours."""
        y = self.shard.compute(layer, np.asarray(x, np.float32), np.asarray(idx), np.asarray(w, np.float32))
        with self._lock:
            self.served_picks += int((np.asarray(idx) >= 0).sum())
        return y

    def set_owners(self, owners: dict[int, np.ndarray]) -> None:
        self.owners = {int(l): np.asarray(o, np.int32) for l, o in owners.items()}

    def counters(self) -> dict[str, Any]:
        with self._lock:
            total = self.local_picks + self.remote_picks
            return {"expert_pins": self.shard.count(), "expert_bytes": self.shard.nbytes(),
                    "local_picks": self.local_picks, "remote_picks": self.remote_picks,
                    "served_picks": self.served_picks,
                    "expert_hit_rate": self.local_picks / total if total else None}
