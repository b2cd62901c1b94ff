"""End to end on a real Ray head: `ray job submit --working-dir . -- python -m cluster generate`.

The head runs under `ray start --head --block` with its own temp dir and free ports, so it
neither meets nor stops any other Ray on the machine; terminating the blocking `ray start`
stops exactly the processes it started (instead of `ray stop`, which stops every Ray here).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from cluster.config import load_job_config
from cluster.jobs.generate import run_generate
from runtime_helpers import (ROOT, free_ports, make_tiny, prepared, prompt_lines, rows_by_id,
                             write_lines)

pytestmark = pytest.mark.slow
N = 12


@pytest.fixture(scope="module")
def ray_head():
    """(dashboard address, GCS address, env) of a fresh head; terminated at the end."""
    venv_bin = str(Path(sys.executable).parent)
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PATH=venv_bin + os.pathsep + os.environ["PATH"])
    env.pop("RAY_ADDRESS", None)
    temp = tempfile.mkdtemp(prefix="kvray")  # short: Ray's unix socket paths must fit
    gcs, dash, agent, agent_grpc, rt_env, metrics, nm, om, client = free_ports(9)
    log = open(Path(temp) / "ray_start.log", "w")
    proc = subprocess.Popen(
        [str(Path(venv_bin) / "ray"), "start", "--head", f"--port={gcs}",
         "--node-ip-address=127.0.0.1", "--num-cpus=2", "--disable-usage-stats",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
         f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
         f"--runtime-env-agent-port={rt_env}", f"--metrics-export-port={metrics}",
         f"--node-manager-port={nm}", f"--object-manager-port={om}",
         f"--ray-client-server-port={client}", f"--temp-dir={temp}", "--block"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (Path(temp) / "ray_start.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(address + "/api/version", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "Ray head did not come up in 180 s"
            time.sleep(1)
        yield address, f"127.0.0.1:{gcs}", env
    finally:
        proc.send_signal(signal.SIGTERM)  # --block stops the processes it started
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(temp, ignore_errors=True)  # sockets of dead processes may linger


def test_ray_job_submit_generates_the_same_as_in_process(ray_head, tmp_path):
    address, _, env = ray_head
    tiny = make_tiny(tmp_path / "tiny")
    prompts = write_lines(tmp_path / "p.jsonl", prompt_lines(N, seed=7))
    out = tmp_path / "out.parquet"
    cmd = ["ray", "job", "submit", "--address", address, "--working-dir", ".", "--",
           "python", "-m", "cluster", "generate", "--prompts", str(prompts), "--out", str(out),
           "--model", str(tiny), "--slots", "4", "--max-tokens", "6"]
    for _ in range(12):  # the dashboard answers before its agent takes jobs
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
        if p.returncode == 0 or "No available agent" not in p.stdout + p.stderr:
            break
        time.sleep(5)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert "joining the Ray cluster" in p.stdout + p.stderr  # the job used the head's Ray
    table = pq.read_table(out)
    ids = table.column("id").to_pylist()
    assert sorted(ids) == sorted(f"q{i}" for i in range(N)) and len(set(ids)) == N
    job_rows = rows_by_id(out)
    assert all(r["finish_reason"] in ("stop", "length") for r in job_rows.values())

    cfg = load_job_config(env={}, overrides={"model": str(tiny), "slots": 4,
                                             "sampling": {"max_tokens": 6},
                                             "workers": {"runtime": "inprocess"}})
    run_generate(cfg, prompts, tmp_path / "local.parquet", progress=False)
    local = rows_by_id(tmp_path / "local.parquet")
    for k, r in local.items():
        assert job_rows[k]["completion_tokens"] == r["completion_tokens"], k
        assert job_rows[k]["completion"] == r["completion"], k


def test_killed_worker_actor_requests_rerun_on_the_other(ray_head, tmp_path):
    """Two worker actors on the head; one is killed after a few results. Its sequences are
    re-run on the other and every completion equals the in-process run."""
    import ray

    from cluster.scheduler import Scheduler
    from workers.actor import LocalGroup, RayGroup, Worker, WorkerSpec
    from workers.tokenizer import Tokenizer

    _, gcs, _ = ray_head
    tiny = make_tiny(tmp_path / "tiny")
    tok = Tokenizer.from_dir(tiny)
    rng = np.random.default_rng(2)
    items = [prepared(i, rng.integers(5, 500, size=int(rng.integers(2, 20))), max_tokens=6)
             for i in range(N)]

    def generate(group, on_each=lambda results: None):
        results = []

        def emit(r):
            results.append(r)
            on_each(results)
        Scheduler(group, max_context=64, prefill_chunk=32, eos_ids=tok.eos_ids,
                  decode=tok.decode, tier="f32").run(items, emit)
        return {r.id: r for r in results}

    spec = lambda name: WorkerSpec(name, str(tiny), "f32", 3, 64)  # noqa: E731
    ref = generate(LocalGroup([Worker(spec("w"))]))
    ray.init(address=gcs)
    try:
        group = RayGroup([(spec("a"), {"num_cpus": 0.5}), (spec("b"), {"num_cpus": 0.5})])

        def kill_b(results):
            if len(results) == 2:
                ray.kill(group.actors[1])
        got = generate(group, kill_b)
        group.close()
    finally:
        ray.shutdown()
    assert set(got) == set(ref)
    for k in ref:
        assert got[k].finish_reason != "error", got[k].error
        assert got[k].completion_tokens == ref[k].completion_tokens, k
    assert {r.worker for r in list(got.values())} <= {"a", "b"}
    assert sum(r.worker == "a" for r in got.values()) > N // 2  # b's share moved to a
