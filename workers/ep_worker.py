"""The expert-parallel worker: a Worker (workers/actor.py: dense weights, its KV slots, one
`step` per scheduler step) that holds only its shard of the routed experts and serves its
peers' picks of them.

As a Ray actor it is threaded: `step` (and the other control calls) run one at a time in
the default concurrency group, `run_experts` and `alive` in the "experts" group, so a
worker blocked in its own step waiting for a peer still answers that peer (no deadlock,
whatever the two are doing), and a worker with no sequences in a step still serves.

Kinds: `metal` runs the MLX model (workers.mlx_model.load_metal; the MLX CPU backend off
Apple silicon), `cuda` the CuPy model (workers.cuda_model.load_cuda; the numpy model, with
a warning, where CuPy sees no GPU), `cpu` the numpy model. Where its routed experts live
(workers/expert_shard.py): a cuda worker running the CuPy model keeps those the plan pins
(`pinned`, from cluster.placement.split_owners) on its GPU and computes them there, its own
picks and its peers' (a peer's call uploads its rows, computes on the worker's device from
an experts-group thread, downloads the answer), and the others in host memory, computed with
numpy; the model loads only the pinned ones, the others are read from the checkpoint into
host memory, so the GPU never holds more than the plan gave it. Every other worker keeps all
of its experts in host memory and computes them with numpy, so on metal peer calls never
touch the MLX stream of the step thread.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from workers import cuda_model
from workers.actor import StepBatch, StepOutput, Worker, WorkerSpec
from workers.expert_shard import ShardedExperts, read_experts, take_shard
from workers.memstats import device_mem_bytes, rss_bytes

log = logging.getLogger(__name__)

EXPERT_GROUP = "experts"  # the Ray concurrency group of run_experts and alive
EXPERT_CALL_THREADS = 16  # its threads: concurrent peer calls served (>= peers - 1 suffices)


class ShardedWorker(Worker):
    """owners: {MoE layer: int32[E] owner rank}, the same table on every worker. pinned:
    {MoE layer: bool[E]}, True where this worker owns the expert and the plan pins it (in
    its device memory); None pins every expert it owns. Only a cuda worker running the CuPy
    model reads it (others hold every expert in host memory)."""

    def __init__(self, spec: WorkerSpec, kind: str, rank: int, owners: dict[int, np.ndarray],
                 pinned: dict[int, np.ndarray] | None = None):
        from cluster.config import resolve_model
        from workers.config import ModelConfig
        self.kind, self.rank = kind, rank
        self.model_dir = resolve_model(spec.model)
        self.cfg = ModelConfig.from_file(self.model_dir / "config.json")
        mine = {int(l): np.flatnonzero(np.asarray(o) == rank) for l, o in owners.items()}
        pin = _pinned(owners, pinned, self.cfg.n_routed_experts)
        pool, host = None, {}
        # MLX streams belong to the thread that made them, and a threaded actor runs calls on
        # pool threads: a metal worker loads and steps its model on one thread of its own.
        self._mlx_thread = ThreadPoolExecutor(1, "mlx") if kind == "metal" else None
        if kind == "metal":
            from workers.mlx_model import load_metal
            model, pool = self._mlx_thread.submit(
                load_metal, self.model_dir, spec.tier, spec.slots, spec.max_context,
                spec.block_size, experts=mine).result()
        elif kind == "cuda" and cuda_model.use_cuda(spec.name):  # else numpy, said once
            rest = {l: ids[~pin[l][ids]] for l, ids in mine.items()}
            mine = {l: ids[pin[l][ids]] for l, ids in mine.items()}  # loaded onto the GPU
            model, pool = cuda_model.load_cuda(self.model_dir, spec.tier, spec.slots,
                                               spec.max_context, spec.block_size, experts=mine)
            host = {l: (rest[l], *stacks) for l, stacks in
                    read_experts(self.model_dir, self.cfg, {l: v for l, v in rest.items() if len(v)}).items()}
        else:
            from workers.model import Model
            from workers.weights import load_params
            model = Model(self.cfg, load_params(self.model_dir, self.cfg, experts=mine))
        # a cuda worker that runs the numpy model: each of its steps is counted as a fallback
        # (path cuda.host_model_steps), beside use_cuda's one warning
        self._host_fallback = kind == "cuda" and pool is None
        self.experts = ShardedExperts(rank, owners, take_shard(model, self.cfg, mine, host))
        model.set_experts(self.experts)
        super().__init__(spec, model=model, pool=pool)
        c = self.experts.counters()
        log.info("%s (%s, rank %d): %d routed experts of %d loaded, %d on the GPU, %d in host "
                 "memory", spec.name, kind, rank, c["expert_pins"], sum(len(o) for o in owners.values()),
                 c["expert_pins_device"], c["expert_pins_host"])

    def info(self) -> dict:
        import ray
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        # model: the class that runs (CudaModel, MLXModel, or Model where a cuda worker fell
        # back to numpy), so a fallback shows in the group's info, not only in a log line
        return dict(super().info(), device=self.kind, rank=self.rank, node_id=node,
                    experts=self.experts.shard.count(), expert_device=self.experts.device,
                    model=type(self.model).__name__)

    def _drain_fallbacks(self) -> dict[str, int]:
        out = super()._drain_fallbacks()
        if self._host_fallback:
            out["cuda.host_model_steps"] = 1
        return out

    def connect(self, peers: dict[int, Any], transport: str = "ray") -> None:
        """Peers by rank: Ray actor handles (transport "ray") or workers in this process
        ("local"). Called once by the group before the first step."""
        from workers.transport import LocalTransport, RayTransport
        peers = {int(r): p for r, p in peers.items() if int(r) != self.rank}
        self.experts.transport = (RayTransport(peers, group=EXPERT_GROUP) if transport == "ray"
                                  else LocalTransport(peers))

    def on_model_thread(self, fn, *args, **kw):
        """fn(*args, **kw) on the thread that owns the model's arrays (MLX), else here."""
        if self._mlx_thread is None:
            return fn(*args, **kw)
        return self._mlx_thread.submit(fn, *args, **kw).result()

    def step(self, batch: StepBatch) -> StepOutput:
        return self.on_model_thread(super().step, batch)

    def run_experts(self, layer: int, x: np.ndarray, idx: np.ndarray, w: np.ndarray) -> np.ndarray:
        return self.experts.serve(layer, x, idx, w)

    def alive(self) -> int:
        return self.rank

    def reassign(self, owners: dict[int, np.ndarray], drop_peers: tuple[int, ...] = (),
                 pinned: dict[int, np.ndarray] | None = None) -> dict:
        """Take the new ownership table: read the experts newly ours from the checkpoint
        (by name; nothing else is read) and forget dead peers. pinned: as in __init__, the
        group's call (cluster/ep_group.py decides which gained experts fit the device room);
        a SplitShard puts the gained pinned ones on the GPU, the others in host memory.
        Returns {layer: ids loaded}."""
        pin = _pinned(owners, pinned, self.cfg.n_routed_experts)
        new = {}
        for l, o in owners.items():
            want = np.flatnonzero(np.asarray(o) == self.rank)
            gained = np.setdiff1d(want, self.experts.shard.ids(int(l)))
            if gained.size:
                new[int(l)] = gained
        for l, (g, u, d) in read_experts(self.model_dir, self.cfg, new).items():
            self.experts.shard.add(l, new[l], g, u, d, pinned=pin[l][new[l]])
        self.experts.set_owners(owners)
        t = self.experts.transport
        for r in drop_peers:
            if t is not None:
                t.peers.pop(int(r), None)
        if new:
            log.info("%s: took over %d experts %s", self.spec.name,
                     sum(len(v) for v in new.values()), {l: v.tolist() for l, v in new.items()})
        return {l: v.tolist() for l, v in new.items()}

    def stats(self) -> dict:
        """Expert counters (workers/expert_shard.py defines the hit rate), memory figures."""
        return dict(self.experts.counters(), name=self.spec.name, device=self.kind,
                    rss_bytes=rss_bytes(),
                    device_mem_bytes=self.on_model_thread(device_mem_bytes, self.kind))


def _pinned(owners: dict, pinned: dict | None, n_experts: int) -> dict[int, np.ndarray]:
    """pinned as {layer: bool[E]} for every layer of owners (None: all True); a table that
    does not match owners is refused, naming the layer."""
    if pinned is None:
        return {int(l): np.ones(n_experts, bool) for l in owners}
    out = {int(l): np.asarray(v, bool) for l, v in pinned.items()}
    if set(out) != {int(l) for l in owners} or any(v.shape != (n_experts,) for v in out.values()):
        raise ValueError(f"pinned: needs a bool[{n_experts}] for each MoE layer of owners "
                         f"{sorted(int(l) for l in owners)}, got "
                         f"{ {l: v.shape for l, v in sorted(out.items())} }")
    return out
