"""A worker actor killed mid-job (ray.kill from the test while the generate job runs on a
three-node cluster, experts sharded): every id comes out exactly once with the single
worker's completions, the dead worker's requests were re-queued, its experts moved to the
survivors, and the job's stats count it."""
from __future__ import annotations

import logging
import threading
import time

import pyarrow.parquet as pq
import pytest

from cluster.config import load_job_config
from cluster.jobs.generate import run_generate
from fleet_cluster import fleet_yaml, start_cluster, stop_cluster
from runtime_helpers import make_tiny, prompt_lines, rows_by_id, write_lines

N = 30
VICTIM = "cuda-b/cuda0"


def config(tiny, **kw):
    over = {"model": str(tiny), "slots": 4, "max_context": 64, "prefill_chunk": 16,
            "flush_every": 2, "workers": {"runtime": "inprocess"}}
    over.update(kw)
    return load_job_config(env={}, overrides=over)


@pytest.mark.slow
def test_killed_worker_loses_no_request(tmp_path, caplog):
    tiny = make_tiny(tmp_path / "tiny")
    prompts = write_lines(tmp_path / "p.jsonl", prompt_lines(N, seed=2, max_tokens=18))
    run_generate(config(tiny), prompts, tmp_path / "ref.parquet", progress=False)
    reference = rows_by_id(tmp_path / "ref.parquet")

    from cluster.footprint import Footprint
    per_slot = Footprint.from_file(tiny).kv_pool_bytes("f32", 1, 64) / 1e9
    slots = (3, 2, 1)
    fleet = fleet_yaml(tmp_path / "fleet.yaml", slots, [8 + s * per_slot for s in slots])
    cfg = config(tiny, workers={"fleet": str(fleet), "experts": "sharded", "num_cpus": 1})
    out = tmp_path / "out.parquet"
    parts = tmp_path / "out.parquet.parts"
    c, ray = start_cluster()
    try:
        caplog.set_level(logging.INFO)
        box: dict = {}
        job = threading.Thread(target=lambda: box.update(s=run_generate(cfg, prompts, out, progress=False)))
        job.start()
        victim = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and job.is_alive():
            if parts.exists() and len(list(parts.glob("part-*.parquet"))) >= 2:  # mid-job
                victim = next(n for n in ray.util.list_named_actors()  # this job's namespace
                              if n.endswith(VICTIM.replace("/", ".")))
                ray.kill(ray.get_actor(victim))
                break
            time.sleep(0.01)
        job.join(timeout=180)
        assert victim is not None and not job.is_alive()
        s = box["s"]
    finally:
        stop_cluster(c, ray)
    ids = pq.read_table(out).column("id").to_pylist()
    assert sorted(ids) == sorted(reference)  # every id exactly once
    rows = rows_by_id(out)
    assert all(r["error"] is None for r in rows.values())
    for k, r in reference.items():
        assert rows[k]["completion_tokens"] == r["completion_tokens"], k
    assert s.stats.worker_deaths == 1 and s.stats.recoveries == 1 and s.stats.requeued >= 1
    assert not any(r["worker"] == VICTIM for r in rows.values() if r["id"] in requeued_ids(caplog))
    text = caplog.text
    assert f"worker {VICTIM} died" in text and "re-queueing its" in text
    moved = [r for r in caplog.records if "of their routed experts moved to" in r.getMessage()]
    assert len(moved) == 1 and moved[0].args[1] > 0  # it held experts; they moved


def requeued_ids(caplog) -> set[str]:
    out: set[str] = set()
    for r in caplog.records:
        if "re-queueing its" in r.getMessage():
            out.update(r.args[-1])
    return out
