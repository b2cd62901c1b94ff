"""The Grafana dashboard (configs/dashboards/kvfleet.json) says what its metrics are: the
expert panel showed kvfleet_expert_pins, every routed expert a worker holds (a cpu worker's
all in host memory), as 'Pinned experts', and the hit rate, picks served by the worker's own
shard, as 'pinned / routed'."""
from __future__ import annotations

import json

from cluster.config import REPO_ROOT

DASHBOARD = REPO_ROOT / "configs" / "dashboards" / "kvfleet.json"


def panels_using(metric: str) -> list[dict]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [p for p in panels if any(metric in t["expr"] for t in p["targets"])]


def test_held_experts_are_split_into_on_the_gpu_and_in_host_memory():
    [panel] = panels_using("ray_kvfleet_expert_pins)")
    exprs = {t["legendFormat"]: t["expr"] for t in panel["targets"]}
    assert exprs == {
        "{{device}} on its GPU":
            "sum by (device) (ray_kvfleet_expert_pins) - sum by (device) (ray_kvfleet_expert_pins_host)",
        "{{device}} in host memory": "sum by (device) (ray_kvfleet_expert_pins_host)"}
    assert "pinned" not in panel["title"].lower() and "host memory" in panel["title"]


def test_the_hit_rate_is_named_for_what_it_counts():
    [panel] = panels_using("ray_kvfleet_expert_hit_rate")
    assert "pinned" not in panel["title"].lower() and "own shard" in panel["title"]
