"""Fault injection for soaks: kill one live kvfleet worker actor every interval (never the
last one alive: a job with no worker left cannot recover, so that tests nothing).

Workers are found through Ray's state API (WORKER_CLASSES, state ALIVE); a worker on
this machine is killed with SIGKILL (a crash, not a polite exit); a named worker elsewhere
is killed with ray.kill. Each kill is recorded with the round and arm that was running.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time

log = logging.getLogger(__name__)

WORKER_CLASSES = ("Worker", "ShardedWorker")  # workers/actor.py, workers/ep_worker.py


def live_workers() -> list:
    from ray.util.state import list_actors
    import ray
    # the connected cluster's address: left out, the state API picks the newest Ray on the
    # machine, which need not be ours
    actors = list_actors(address=ray.get_runtime_context().gcs_address,
                         filters=[("state", "=", "ALIVE")], detail=True,
                         raise_on_missing_output=False)
    return [a for a in actors if a.class_name in WORKER_CLASSES]


def kill_worker(actor) -> int | None:
    """Kill one actor (a state-API record). Returns the pid killed, or None."""
    import ray
    local = actor.node_id == ray.get_runtime_context().get_node_id()
    if local and actor.pid:
        os.kill(actor.pid, signal.SIGKILL)
        return actor.pid
    if actor.name:
        ray.kill(ray.get_actor(actor.name, namespace=actor.ray_namespace))
        return actor.pid
    log.warning("cannot kill worker %s: not on this node and not named", actor.actor_id)
    return None


class WorkerKiller(threading.Thread):
    def __init__(self, every_s: float):
        super().__init__(name="soak-killer", daemon=True)
        self.every_s = every_s
        self.round: tuple[int, str] = (-1, "")  # set by the soak loop
        self.events: list[dict] = []
        self._stop_evt = threading.Event()

    def run(self) -> None:
        while not self._stop_evt.wait(self.every_s):
            try:
                actors = live_workers()
            except Exception as e:  # the state API can be briefly unavailable: try next tick
                log.warning("fault injector: cannot list workers (%s)", e)
                continue
            if len(actors) < 2:  # never the last live worker: nothing could recover from that
                continue
            victim = actors[len(self.events) % len(actors)]
            pid = kill_worker(victim)
            if pid is None:
                continue
            rnd, arm = self.round
            log.warning("fault injector: killed worker %s (pid %s) during round %d arm %s",
                        victim.name or victim.actor_id[:8], pid, rnd, arm)
            self.events.append({"time_s": time.time(), "round": rnd, "arm": arm,
                                "worker": victim.name or victim.actor_id, "pid": pid})

    def stop(self) -> None:
        self._stop_evt.set()
        self.join(timeout=5)
