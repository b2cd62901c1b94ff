"""Workers that no node of the cluster can host: a fleet's `cuda` node on a cluster with no
GPU, a node's label or custom resource that no Ray node has, more devices than the nodes
offer together. The job waited out its start timeout (600 s) on an actor Ray kept pending,
then failed with a traceback; now it fails before making any actor, with one line naming the
worker (its fleet node), what it asks for and what each node lacks. Bad `resources` / label
keys, which Ray took only as far as the actor's creation (a traceback), are refused when the
fleet file or job config is loaded, naming the field."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cluster.config import JobConfigError, load_job_config
from cluster.fleet import Fleet, FleetError
from cluster.ray_options import PLAIN_FIELDS, check_placeable
from runtime_helpers import ROOT, write_lines

ENV = dict(os.environ, PYTHONPATH=str(ROOT), RAY_AUTH_MODE="disabled")


@pytest.mark.parametrize("extra, where, why", [
    ("resources: {GPU: 2}", "nodes.1.resources", "'GPU' is one of Ray's own resources"),
    ("resources: {CPU: 1}", "nodes.1.resources", "'CPU' is one of Ray's own resources"),
    ("resources: {memory: 8}", "nodes.1.resources", "'memory' is one of Ray's own resources"),
    ("resources: {box: 0}", "nodes.1.resources", "box=0: an amount must be > 0"),
    ("labels: {'zone a': x}", "nodes.1.labels", "label key 'zone a' is not one Ray takes"),
    ("labels: {'-zone': x}", "nodes.1.labels", "label key '-zone' is not one Ray takes"),
    ("labels: {'x/y/zone': x}", "nodes.1.labels", "label key 'x/y/zone' is not one Ray takes"),
    ("labels: {zone: 'in(a,'}", "nodes.1.labels", "label zone: 'in(a,' is no Ray label selector value"),
    ("labels: {zone: 'a b'}", "nodes.1.labels", "label zone: 'a b' is no Ray label selector value"),
])
def test_what_ray_would_refuse_at_the_actor_is_a_fleet_error(tmp_path, extra, where, why):
    f = tmp_path / "fleet.yaml"
    f.write_text("nodes:\n  - {name: a, kind: cpu, memory: 4}\n"
                 f"  - {{name: b, kind: cuda, memory: 8, {extra}}}\n")
    with pytest.raises(FleetError) as e:
        Fleet.from_file(f)
    assert str(e.value).startswith(f"{f}: {where}: ") and why in str(e.value)


def test_label_syntax_is_rays():
    """The fleet's check agrees with Ray's own, which runs only when the actor is made."""
    from ray._private.label_utils import validate_label_selector

    from cluster.ray_options import labels_error
    for sel in ({"zone": "a"}, {"zone": "!a"}, {"zone": "in(a, b)"}, {"zone": "!in(a,b)"},
                {"example.com/zone": "a-1"}, {"k": ""}, {"zone a": "x"}, {"-k": "x"}, {"k-": "x"},
                {"a..b/k": "x"}, {"k": "in()"}, {"k": "a b"}, {"k": "!!a"}, {"k" * 64: "x"},
                {"k": "in(a, -b)"}, {"x/y/z": "a"}):
        assert (labels_error(sel) is None) == (validate_label_selector(sel) is None), sel


def test_the_job_configs_workers_resources_are_checked_alike():
    with pytest.raises(JobConfigError, match="workers.resources: .*'GPU' is one of Ray's own"):
        load_job_config(env={}, overrides={"workers": {"resources": {"GPU": 1}}})
    with pytest.raises(JobConfigError, match="workers.label_selector: .*label key '-k' is not one Ray takes"):
        load_job_config(env={}, overrides={"workers": {"label_selector": {"-k": "v"}}})
    w = load_job_config(env={}, overrides={"workers": {"resources": {"x": 0.5},
                                                       "label_selector": {"zone": "!in(a, b)"}}}).workers
    assert (w.resources, w.label_selector) == ({"x": 0.5}, {"zone": "!in(a, b)"})


def test_generate_with_a_gpu_resource_in_the_fleet_is_a_one_line_usage_error(tmp_path):
    """(It was an AssertionError traceback from ray.init, exit 1, once Ray was starting.)"""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("nodes:\n  - {name: box, kind: cpu, memory: 4, reserve_gb: 1, resources: {GPU: 1}}\n")
    job = tmp_path / "job.yaml"
    job.write_text(f"max_context: 128\nworkers: {{fleet: {fleet}, experts: sharded}}\n")
    prompts = write_lines(tmp_path / "p.jsonl", ['{"id": "a", "prompt": "hello"}'])
    r = subprocess.run([sys.executable, "-m", "cluster", "generate", "--config", str(job), "--prompts",
                        str(prompts), "--out", str(tmp_path / "o.parquet")], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert f"{fleet}: nodes.0.resources: 'GPU' is one of Ray's own resources" in r.stderr


@pytest.mark.slow
def test_a_fleet_node_no_ray_node_matches_fails_at_once_naming_it(tmp_path):
    """The job's own local Ray offers the fleet's kvfleet_<kind> resources but no labels: a
    node with `labels` can never be placed there. It fails in seconds (the old code waited
    600 s for the actor, then raised a traceback)."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("nodes:\n  - {name: host, kind: cpu, memory: 4, reserve_gb: 1, slots: 2}\n"
                     "  - {name: zoned, kind: cpu, memory: 4, reserve_gb: 1, labels: {zone: b}}\n")
    job = tmp_path / "job.yaml"
    job.write_text(f"max_context: 128\nworkers: {{fleet: {fleet}, experts: sharded}}\n")
    prompts = write_lines(tmp_path / "p.jsonl", ['{"id": "a", "prompt": "hello"}'])
    env = {k: v for k, v in ENV.items() if k != "RAY_ADDRESS"}
    r = subprocess.run([sys.executable, "-m", "cluster", "generate", "--config", str(job), "--prompts",
                        str(prompts), "--out", str(tmp_path / "o.parquet")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=150)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"kvfleet generate: error: workers.fleet {fleet}: worker zoned/cpu0 asks "
                           "Ray for CPU 1, kvfleet_cpu 1, label zone=b, which no node of the cluster "
                           "has"), last
    assert "lacks label zone=b" in last and "Traceback" not in r.stderr


@pytest.mark.slow
def test_check_placeable_on_a_two_node_cluster():
    """Per worker: some node has everything it asks for (resources, GPU, labels); together:
    no resource asked for beyond what all nodes have."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray
    from ray.cluster_utils import Cluster
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "num_gpus": 0, "resources": {"kvfleet_cuda": 1}, "include_dashboard": False})
    c.add_node(num_cpus=2, num_gpus=0, resources={"kvfleet_cpu": 2}, labels={"zone": "a"})
    try:
        ray.init(address=c.address)
        c.wait_for_nodes()
        cpu = {"num_cpus": 1, "resources": {"kvfleet_cpu": 1}, "label_selector": {"zone": "a"}}
        check_placeable(ray, [("a/cpu0", cpu), ("a/cpu1", cpu),
                              ("b/cpu0", {"num_cpus": 1, "label_selector": {"zone": "!in(b, c)"}})], "F")
        cuda = {"num_cpus": 1, "num_gpus": 1, "resources": {"kvfleet_cuda": 1}}
        with pytest.raises(JobConfigError) as e:  # the kvfleet_cuda node has no GPU
            check_placeable(ray, [("a/cpu0", cpu), ("gpu-box/cuda0", cuda)], "workers.fleet F")
        msg = str(e.value)
        assert msg.startswith("workers.fleet F: worker gpu-box/cuda0 asks Ray for CPU 1, GPU 1, "
                              "kvfleet_cuda 1 (a cuda device asks for one GPU"), msg
        assert msg.count("lacks") == 2 and "lacks GPU 1 (has 0)" in msg and "kvfleet_cuda 1 (has 0)" in msg
        with pytest.raises(JobConfigError, match=r"worker b/cpu0 .*label zone=b.*lacks label zone=b \(has a\)"):
            check_placeable(ray, [("b/cpu0", dict(cpu, label_selector={"zone": "b"}))], PLAIN_FIELDS)
        with pytest.raises(JobConfigError, match="the 3 workers ask Ray for kvfleet_cpu 3 in all, but "
                                                 "the cluster's nodes have 2"):
            check_placeable(ray, [(f"a/cpu{i}", cpu) for i in range(3)], "F")
        # an actor given no num_cpus needs one CPU to be placed and holds none after
        check_placeable(ray, [(f"w{i}", {}) for i in range(6)], PLAIN_FIELDS)
    finally:
        ray.shutdown()
        c.shutdown()


def test_an_autoscaling_cluster_can_wait_for_its_nodes(monkeypatch, caplog):
    """A KubeRay / `ray up` cluster adds a GPU node when an actor asks for one: refusing the
    job at once (no live node has a GPU) left such clusters no way to run. The error says
    how to wait instead, and KVFLEET_WAIT_FOR_NODES=1 makes it a warning."""
    import logging

    class OneCpuNode:  # (ray.nodes() as Ray returns it, for a cluster of one CPU node)
        @staticmethod
        def nodes():
            return [{"Alive": True, "NodeID": "ab" * 8, "NodeManagerAddress": "10.0.0.1",
                     "Resources": {"CPU": 4.0, "kvfleet_cpu": 1.0}, "Labels": {}},
                    {"Alive": False, "NodeID": "cd" * 8, "NodeManagerAddress": "10.0.0.2",
                     "Resources": {"CPU": 8.0, "GPU": 1.0, "kvfleet_cuda": 1.0}, "Labels": {}}]
    cuda = [("gpu-box/cuda0", {"num_cpus": 1, "num_gpus": 1, "resources": {"kvfleet_cuda": 1}})]
    monkeypatch.delenv("KVFLEET_WAIT_FOR_NODES", raising=False)
    with pytest.raises(JobConfigError, match=r"worker gpu-box/cuda0 .* set KVFLEET_WAIT_FOR_NODES=1 "
                                             r"to wait for them\)$"):
        check_placeable(OneCpuNode, cuda, "workers.fleet F")
    monkeypatch.setenv("KVFLEET_WAIT_FOR_NODES", "1")
    with caplog.at_level(logging.WARNING, logger="cluster.ray_options"):
        check_placeable(OneCpuNode, cuda, "workers.fleet F")
    assert "worker gpu-box/cuda0 asks Ray for" in caplog.text and "waiting for the cluster" in caplog.text
    check_placeable(OneCpuNode, [("w0", {"num_cpus": 1, "resources": {"kvfleet_cpu": 1}})], "F")
