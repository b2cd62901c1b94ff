"""The soak's fault injector (cluster/soak/faults.py) on a cluster of two nodes: a worker on
a node other than the soak driver's cannot be SIGKILLed from here, so it is killed by its
name; replicated workers (RayGroup) had none and were never killed there."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

from runtime_helpers import free_ports

pytestmark = pytest.mark.slow


def test_the_injector_kills_a_replicated_worker_on_another_node(tiny, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    import ray
    from ray.cluster_utils import Cluster
    from cluster.soak.faults import WorkerKiller, live_workers
    from workers.actor import RayGroup, StepBatch, WorkerSpec
    (dashboard_port,) = free_ports(1)
    # the head (the driver's node) hosts no worker: both go to the node offering "far"
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": True, "dashboard_host": "127.0.0.1",
        "dashboard_port": dashboard_port})  # (the state API lists the actors)
    c.add_node(num_cpus=2, resources={"far": 2})
    ray.init(address=c.address)
    killer = None
    try:
        c.wait_for_nodes()
        group = RayGroup([(WorkerSpec(f"w{i}", str(tiny), "f32", 2, 64),
                           {"num_cpus": 0.5, "resources": {"far": 1}}) for i in range(2)])
        here = ray.get_runtime_context().get_node_id()
        workers = live_workers()
        assert len(workers) == 2 and all(w.node_id != here for w in workers)
        killer = WorkerKiller(0.5)
        killer.start()
        deadline = time.monotonic() + 60
        while not killer.events and time.monotonic() < deadline:
            time.sleep(0.2)
        killer.stop()
        assert len(killer.events) == 1, "no worker on the other node was killed"
        # the job finds it dead at its next step (as it recovers from any kill)
        empty = StepBatch(keys=np.zeros(0, np.int64), tokens=np.zeros(0, np.int32),
                          positions=np.zeros(0, np.int32), sample_at=np.zeros(0, np.int32),
                          temperature=np.zeros(0, np.float32), top_p=np.zeros(0, np.float32),
                          seed=np.zeros(0, np.uint64), counter=np.zeros(0, np.uint64))
        outs = group.step_all({i: empty for i in range(2)})
        dead = [i for i, o in outs.items() if isinstance(o, ray.exceptions.RayActorError)]
        assert len(dead) == 1 and group.is_dead(dead[0], outs[dead[0]])
        assert killer.events[0]["pid"] == group.info[dead[0]]["pid"] != os.getpid()
    finally:
        if killer is not None:
            killer.stop()
        ray.shutdown()
        c.shutdown()
