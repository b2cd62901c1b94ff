"""The metrics the Grafana dashboard queries reach Prometheus: a Ray started with a metrics
export port on loopback, a real generate job (expert-parallel, two workers, a polar tier so
the fallback counter moves, a worker killed mid-job), then a scrape of the endpoint."""
from __future__ import annotations

import json
import re
import time
import urllib.request

import pyarrow.parquet as pq
import pytest

from cluster.config import REPO_ROOT, load_job_config
from runtime_helpers import free_ports, make_tiny, prompt_lines, write_lines

pytestmark = pytest.mark.slow
DASHBOARD = REPO_ROOT / "configs" / "dashboards" / "kvfleet.json"


def _scrape(port: int) -> dict[str, float]:
    """Sum of every sample per metric name (labels dropped) from the Prometheus text."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(ray_kvfleet_\w+)(\{[^}]*\})? ([-+0-9.eEinfNa]+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def _paths(port: int) -> dict[str, float]:
    """ray_kvfleet_fallbacks_total by its path tag."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^ray_kvfleet_fallbacks_total\{[^}]*\bpath="([^"]+)"[^}]*\} ([-+0-9.eEinfNa]+)$', text,
        re.M)}


def _wait_for(port: int, ok, what: str, timeout_s: float = 90.0, scrape=_scrape) -> dict:
    """Scrape until ok(metrics) holds; the metrics agent exports on its own period."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = scrape(port)
        if ok(got):
            return got
        assert time.monotonic() < deadline, f"never saw {what}; last scrape: {got}"
        time.sleep(2)


def _dashboard_metrics() -> set[str]:
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    names = set(re.findall(r"ray_kvfleet_\w+", " ".join(exprs)))
    return {re.sub(r"_bucket$", "_count", n) for n in names}


def _kill_one_worker_at_step(monkeypatch, step: int, killed: list) -> None:
    """SIGKILL one of the job's worker actors just before its group's `step`-th step: mid-job
    on any machine (a kill a few seconds after the workers were up came after the job's end
    where the job ran faster than that)."""
    from cluster import ep_group
    from cluster.soak.faults import kill_worker, live_workers
    real, calls = ep_group.ShardedGroup.step_all, []

    def step_all(self, batches):
        calls.append(1)
        if len(calls) == step:
            killed.append(kill_worker(live_workers()[0]))
        return real(self, batches)
    monkeypatch.setattr(ep_group.ShardedGroup, "step_all", step_all)


def test_prometheus_endpoint_has_every_dashboard_metric(tmp_path, monkeypatch):
    import ray
    from cluster.jobs.generate import run_generate
    from cluster.soak.runner import FailedRoundsCounter, RatioGauge
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    port, dashboard_port = free_ports(2)
    ray.init(address="local", num_cpus=2, include_dashboard=True, dashboard_host="127.0.0.1",
             dashboard_port=dashboard_port, _metrics_export_port=port)
    try:
        # 0. the untagged counters are on the endpoint at 0 before their first increment
        # (else increase() / rate() miss that step: a job's only death read as 0)
        from cluster.metrics import JobMetrics
        JobMetrics(use_ray=True)
        _wait_for(port, lambda g: all(g.get(f"ray_kvfleet_{n}_total") == 0 for n in (
            "worker_deaths", "requests_requeued", "experts_moved", "tokens_generated",
            "tokens_rerun", "kv_cache")), "the counters at 0")
        # (and the fallbacks at every declared path: workers/fallbacks.py)
        from workers.fallbacks import FALLBACK_PATHS
        _wait_for(port, lambda g: g == dict.fromkeys(FALLBACK_PATHS, 0.0),
                  "every fallback path at 0", scrape=_paths)
        model = make_tiny(tmp_path / "model")
        prompts = write_lines(tmp_path / "p.jsonl", prompt_lines(24, seed=9, max_tokens=48))
        cfg = load_job_config(None, env={}, overrides={
            "model": str(model), "kv": "polar4", "slots": 4, "max_context": 256,
            "workers": {"count": 2, "experts": "sharded", "num_cpus": 0.5}})
        # 1. a clean job: the token counter equals what the Parquet holds
        run_generate(cfg, prompts, tmp_path / "clean.parquet")
        rows = pq.read_table(tmp_path / "clean.parquet").to_pylist()
        assert len(rows) == 24 and all(r["finish_reason"] in ("stop", "length") for r in rows)
        # the completion leaves out the EOS that ended a "stop" row; the counter has it
        parquet_tokens = sum(r["completion_token_count"] + (r["finish_reason"] == "stop")
                             for r in rows)
        got = _wait_for(port, lambda g: g.get("ray_kvfleet_tokens_generated_total") == parquet_tokens,
                        f"tokens generated == {parquet_tokens} from the Parquet")
        assert got["ray_kvfleet_fallbacks_total"] > 0  # polar rows rebuilt on the CPU
        assert got["ray_kvfleet_time_to_first_token_s_count"] == 24
        # 2. the same job with a worker killed mid-way, and a soak round's ratios
        killed = []
        _kill_one_worker_at_step(monkeypatch, 4, killed)  # (the job takes 100+ steps)
        summary = run_generate(cfg, prompts, tmp_path / "killed.parquet")
        assert killed and killed[0] is not None, "the worker was not killed mid-job"
        rows = pq.read_table(tmp_path / "killed.parquet").to_pylist()
        assert len(rows) == 24
        # the job's tokens: each delivered one once; the counter: every one sampled, the
        # dead worker's lost ones too, which kvfleet_tokens_rerun has apart
        killed_tokens = sum(r["completion_token_count"] + (r["finish_reason"] == "stop")
                            for r in rows)
        lost = summary.stats.rerun_tokens
        assert summary.stats.tokens == killed_tokens and lost > 0
        RatioGauge().publish({"throughput_tok_s": 100.0}, {"throughput_tok_s": 97.0})
        FailedRoundsCounter(["A", "B"]).failed("B")
        want = _dashboard_metrics()
        sampled = parquet_tokens + killed_tokens + lost  # (both jobs')
        got = _wait_for(port, lambda g: not (want - set(g)) and "ray_kvfleet_soak_ratio" in g
                        and g["ray_kvfleet_soak_failed_rounds_total"] == 1
                        and g.get("ray_kvfleet_tokens_generated_total") == sampled
                        and g.get("ray_kvfleet_tokens_rerun_total") == lost,
                        f"every dashboard metric: {sorted(want)}, {sampled} tokens sampled, "
                        f"{lost} of them lost with the dead worker")
        assert got["ray_kvfleet_worker_deaths_total"] == 1
        assert got["ray_kvfleet_requests_requeued_total"] == summary.stats.requeued >= 1
        assert got["ray_kvfleet_experts_moved_total"] >= 1
        assert got["ray_kvfleet_expert_pins"] > 0
        assert abs(got["ray_kvfleet_soak_ratio"] - 0.97) < 1e-9
        assert got["ray_kvfleet_soak_failed_rounds_total"] == 1  # (A's series at 0, B's at 1)
    finally:
        ray.shutdown()
