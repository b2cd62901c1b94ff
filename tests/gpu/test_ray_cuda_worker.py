"""A `cuda` ShardedWorker as a real Ray actor on a real GPU: a one-node Ray cluster with one
GPU (kvfleet_cuda) and a host device (kvfleet_cpu), experts sharded between the CuPy worker
and a numpy worker, the scheduler's greedy completions equal to a single in-process numpy
worker's. The cuda actor must have run the CuPy model (the group's info names the model
class), not the numpy fallback, with its routed experts on the GPU (its stats say
expert_device "cuda", with the float32 bytes of the experts it holds; the cpu worker's
"host")."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("cupy")
from kernels.cuda._build import cuda_available  # noqa: E402

if not cuda_available():
    pytest.skip("no CUDA device", allow_module_level=True)
ray = pytest.importorskip("ray")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
from runtime_helpers import job_config, make_tiny, prompt_lines, rows_by_id, write_lines  # noqa: E402

N = 8


@pytest.mark.parametrize("kv", ["f32", "kv8"])
def test_sharded_job_with_a_cuda_actor_matches_the_numpy_worker(tmp_path, kv):
    from cluster.ep_group import start_group
    from cluster.jobs.generate import _eos, _prepare, run_generate
    from cluster.metrics import JobMetrics
    from cluster.requests import read_requests
    from cluster.scheduler import Scheduler
    from workers.config import ModelConfig
    from workers.tokenizer import Tokenizer

    tiny = make_tiny(tmp_path / "tiny")
    prompts = write_lines(tmp_path / "p.jsonl", prompt_lines(N))
    run_generate(job_config(tiny, kv=kv), prompts, tmp_path / "ref.parquet", progress=False)
    reference = rows_by_id(tmp_path / "ref.parquet")

    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("nodes:\n"
                     "  - {name: gpu, kind: cuda, memory: 8, reserve_gb: 1, slots: 2}\n"
                     "  - {name: host, kind: cpu, memory: 8, reserve_gb: 1, slots: 2}\n")
    cfg = job_config(tiny, kv=kv, workers={"fleet": str(fleet), "experts": "sharded",
                                           "num_cpus": 1})
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(num_cpus=4, num_gpus=1, resources={"kvfleet_cuda": 1, "kvfleet_cpu": 1},
             include_dashboard=False, log_to_driver=False)
    try:
        group, close = start_group(cfg)
        try:
            assert [(i["device"], i["model"], i["expert_device"]) for i in group.info] == \
                [("cuda", "CudaModel", "cuda"), ("cpu", "Model", "host")]
            before = group.worker_stats()
            tok = Tokenizer.from_dir(tiny)
            mcfg = ModelConfig.from_file(tiny / "config.json")
            items = [_prepare(r, cfg, tok, mcfg.vocab_size) for r in read_requests(prompts)]
            results = []
            Scheduler(group, max_context=cfg.max_context, prefill_chunk=cfg.prefill_chunk,
                      eos_ids=_eos(tok, mcfg), decode=tok.decode, tier=cfg.kv,
                      metrics=JobMetrics(enabled=False)).run(items, results.append)
            got = {r.id: r for r in results}
            assert len(got) == N and all(r.error is None for r in got.values())
            assert {r.worker.split("/")[0] for r in got.values()} == {"gpu", "host"}
            for k, r in reference.items():
                assert got[k].completion_tokens == r["completion_tokens"], (kv, k)
            stats = group.worker_stats()
            gpu = stats[0]
            assert gpu["name"].startswith("gpu/"), gpu
            assert gpu["device_mem_bytes"] is not None and gpu["device_mem_bytes"] > 2**20, gpu
            assert gpu["served_picks"] > before[0]["served_picks"]
            assert [s["expert_device"] for s in stats] == ["cuda", "host"]
            per = 3 * mcfg.moe_intermediate_size * mcfg.hidden_size * 4  # float32 gate, up, down
            assert all(s["expert_bytes"] == s["expert_pins"] * per > 0 for s in stats), stats
            assert sum(s["served_picks"] for s in stats) == sum(s["remote_picks"] for s in stats)
        finally:
            close()
    finally:
        ray.shutdown()
