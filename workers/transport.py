"""How routed tokens reach the worker that owns their expert, and come back.

Inside one MoE layer of a lockstep step, a worker (workers/expert_shard.ShardedExperts)
sends each peer the rows of its tokens that picked one of that peer's experts:

    run_experts(layer, x [n, hidden] f32, idx [n, k] expert ids (-1 = not yours), w [n, k])
        -> y [n, hidden] f32 = sum over the picks of w * expert(x)

and adds the answers to what it computed itself. A transport is `submit` (start one call,
return a handle at once, so all peers work while the caller computes its own shard) and
`gather` (wait for the handles). The peer side is any object with that `run_experts`.

Implementations:
  LocalTransport  workers in one process (tests, `runtime: inprocess`): calls the peer now.
  RayTransport    between any Ray actors (CPU hosts, Macs, CUDA boxes without NCCL): one actor
                  call per peer and layer. The peer must serve it while its own step runs, so
                  the worker actor is threaded: `run_experts` lives in its own concurrency group
                  (workers/ep_worker.py), the step in the default one. A worker with no tokens
                  in a step is simply idle and still serves. A dead peer makes `gather` raise
                  (ray.exceptions.ActorDiedError), the step fails and the group recovers.

Where an NCCL transport goes (not implemented): between CUDA workers the exchange should be
one all-to-all per MoE layer through cupy.cuda.nccl on device buffers, not actor calls. It
is a collective, so unlike RayTransport every CUDA worker must enter it in every step and
layer, including one with no tokens (it sends and receives zero rows): the group would
then step idle CUDA workers with empty batches, and a death is seen as an NCCL error or
timeout on the survivors (the communicator must be rebuilt without the dead rank before
the retry). It would implement the same submit/gather pair (submit = post the send counts
and the all-to-all on a stream, gather = synchronize), keyed on a communicator built once
from a `ncclUniqueId` the group hands to every CUDA worker with `connect`.
"""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class ExpertServer(Protocol):
    def run_experts(self, layer: int, x: np.ndarray, idx: np.ndarray, w: np.ndarray) -> np.ndarray: ...


class ExpertTransport(Protocol):
    def submit(self, peer: int, layer: int, x: np.ndarray, idx: np.ndarray, w: np.ndarray) -> Any: ...

    def gather(self, handles: dict[int, Any]) -> dict[int, np.ndarray]: ...


class LocalTransport:
    """Peers in this process, by rank: the call runs inside `submit`."""

    def __init__(self, peers: dict[int, ExpertServer]):
        self.peers = peers

    def submit(self, peer, layer, x, idx, w):
        return self.peers[peer].run_experts(layer, x, idx, w)

    def gather(self, handles):
        return dict(handles)


class RayTransport:
    """Peers are Ray actor handles, by rank. `timeout_s` bounds the wait for a peer that is
    neither answering nor known dead (a node that vanished before Ray noticed)."""

    def __init__(self, peers: dict[int, Any], timeout_s: float = 300.0, group: str = "experts"):
        self.peers, self.timeout_s, self.group = peers, timeout_s, group

    def submit(self, peer, layer, x, idx, w):
        call = self.peers[peer].run_experts.options(concurrency_group=self.group)
        return call.remote(layer, x, idx, w)

    def gather(self, handles):
        import ray
        ranks = list(handles)
        try:
            values = ray.get([handles[r] for r in ranks], timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"expert peers {ranks} did not answer within {self.timeout_s:.0f}s") from None
        return dict(zip(ranks, values))
