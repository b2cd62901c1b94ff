"""Plausible user mistakes on the `kvfleet` commands: each is exit 2 with one line that
names the flag or field and the path, never a traceback (and never a run that reports a
pass or a plan while ignoring what it was given)."""
from __future__ import annotations

import json
import sys

import pytest

from cluster.cli import main
from runtime_helpers import ROOT, prompt_lines, write_lines


def run_cli(capsys, *argv) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


# -- generate -----------------------------------------------------------------------------
def gen_args(tiny, tmp_path, *extra) -> list[str]:
    prompts = write_lines(tmp_path / "p.jsonl", prompt_lines(2))
    return ["generate", "--prompts", str(prompts), "--model", str(tiny), "--inprocess",
            "--max-tokens", "2", *extra]


def test_generate_given_a_fleet_file_says_so(tmp_path, capsys):
    """It listed the fleet's `plan` and `nodes` as 'Extra inputs are not permitted'."""
    fleet = ROOT / "configs" / "fleets" / "local-sharded.yaml"
    prompts = write_lines(tmp_path / "p.jsonl", prompt_lines(2))
    code, err = run_cli(capsys, "generate", "--config", str(fleet), "--prompts", str(prompts),
                        "--out", str(tmp_path / "out.parquet"), "--inprocess")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"{fleet}: is a fleet file" in err and "workers: {fleet: configs/fleets/local-sharded.yaml}" in err
    assert not (tmp_path / "out.parquet").exists()


def test_generate_out_that_is_a_directory(tiny, tmp_path, capsys):
    """It read the directory as an empty Parquet dataset and said 'not a kvfleet results
    file (missing [every column])'."""
    d = tmp_path / "outdir"
    d.mkdir()
    code, err = run_cli(capsys, *gen_args(tiny, tmp_path, "--out", str(d)))
    assert code == 2
    assert f"--out {d}: is a directory; give the results file to write, e.g. {d}/results.parquet" in err
    assert list(d.iterdir()) == []


def test_generate_stats_that_is_a_directory_is_refused_before_the_run(tiny, tmp_path, capsys):
    """It ran the whole job, then ended in an IsADirectoryError traceback."""
    d = tmp_path / "statsdir"
    d.mkdir()
    out = tmp_path / "out.parquet"
    code, err = run_cli(capsys, *gen_args(tiny, tmp_path, "--out", str(out), "--stats", str(d)))
    assert code == 2 and f"--stats {d}: is a directory" in err
    assert not out.exists()  # refused before anything ran


def test_generate_stats_that_cannot_be_written_names_the_flag(tiny, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = tmp_path / "out.parquet"
    code, err = run_cli(capsys, *gen_args(tiny, tmp_path, "--out", str(out),
                                          "--stats", str(blocker / "stats.json")))
    assert code == 2 and f"--stats {blocker / 'stats.json'}: cannot write it" in err
    assert f"the results are in {out}" in err and out.exists()


def test_generate_out_whose_folder_cannot_be_made(tiny, tmp_path, capsys):
    """An --out under a regular file: a FileExistsError traceback from ResultStore's mkdir."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = blocker / "sub" / "out.parquet"
    code, err = run_cli(capsys, *gen_args(tiny, tmp_path, "--out", str(out)))
    assert code == 2
    assert f"--out {out}: cannot create its folder {blocker / 'sub'}" in err
    assert blocker.read_text() == "x"


def test_generate_kv_cache_dir_that_is_a_file(tiny, tmp_path, capsys):
    """A worker failed to create it: a FileExistsError traceback from kvstore/slots.py."""
    f = tmp_path / "cache"
    f.write_text("not a dir")
    code, err = run_cli(capsys, *gen_args(tiny, tmp_path, "--out", str(tmp_path / "o.parquet"),
                                          "--kv-cache-dir", str(f)))
    assert code == 2 and f"kv_cache_dir {f}: exists and is not a directory" in err
    assert "--kv-cache-dir" in err


def test_generate_kv_cache_dir_that_cannot_be_made(tiny, tmp_path, capsys):
    """A file or a dangling link on its path: each worker's makedirs raised (in-process a
    NotADirectoryError traceback; through Ray "all 1 worker actors died while starting")."""
    f = tmp_path / "notes.txt"
    f.write_text("not a dir")
    (tmp_path / "gone").symlink_to(tmp_path / "unmounted" / "share")
    for d, on_way in ((f / "cache", f), (f / "a" / "b", f), (tmp_path / "gone" / "kv", tmp_path / "gone")):
        out = tmp_path / "o.parquet"
        code, err = run_cli(capsys, *gen_args(tiny, tmp_path, "--out", str(out), "--kv-cache-dir", str(d)))
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"kv_cache_dir {d}: cannot be made: {on_way} is not a directory" in err, err
        assert "--kv-cache-dir" in err and not out.exists()
    assert f.read_text() == "not a dir"


def test_generate_empty_kv_cache_dir_is_refused_not_the_cwd(tiny, tmp_path, capsys, monkeypatch):
    """`--kv-cache-dir "$CACHE"` with CACHE unset, or `kv_cache_dir: ""`, is Path(""): the
    job saved every request's KV into the working directory, exit 0."""
    monkeypatch.chdir(tmp_path)
    job = tmp_path / "job.yaml"
    job.write_text('kv_cache_dir: ""\n')
    for extra, source in ((["--kv-cache-dir", ""], "(from flags)"),
                          (["--config", str(job)], f"{job}: kv_cache_dir:")):
        out = tmp_path / "o.parquet"
        code, err = run_cli(capsys, *gen_args(tiny, tmp_path, "--out", str(out), *extra))
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "kv_cache_dir" in err and source in err and "must be a directory path" in err, err
        assert not out.exists() and not list(tmp_path.glob("*.arrow*")), list(tmp_path.iterdir())


def test_generate_empty_prompts_file_warns(tiny, tmp_path, caplog):
    from cluster.jobs.generate import run_generate
    from runtime_helpers import job_config
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with caplog.at_level("WARNING"):
        s = run_generate(job_config(tiny), empty, tmp_path / "o.parquet", progress=False)
    assert s.done == 0
    assert f"--prompts {empty}: no requests in it" in caplog.text


# -- score --------------------------------------------------------------------------------
def test_score_tokens_that_is_a_directory(tiny, tmp_path, capsys):
    """An IsADirectoryError traceback (only a missing file was caught)."""
    d = tmp_path / "ids"
    d.mkdir()
    code, err = run_cli(capsys, "score", "--model", str(tiny), "--tokens", str(d),
                        "--out", str(tmp_path / "l.npy"))
    assert code == 2 and f"--tokens {d}: cannot read it" in err


def test_score_out_whose_folder_cannot_be_made_is_refused_before_the_forward(tiny, tmp_path,
                                                                            capsys, monkeypatch):
    """A FileExistsError traceback, after the weights had loaded and the forward had run."""
    from workers.model import Model
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([3, 1, 4, 1, 5]))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = blocker / "l.npy"
    monkeypatch.setattr(Model, "load", lambda *a, **k: pytest.fail("loaded the weights"))
    code, err = run_cli(capsys, "score", "--model", str(tiny), "--tokens", str(ids),
                        "--out", str(out))
    assert code == 2 and f"--out {out}: cannot create its folder {blocker}" in err


# -- plan ---------------------------------------------------------------------------------
CARD = ROOT / "configs" / "models" / "glm-5.2.json"


@pytest.mark.parametrize("flag", [["--usage", "u.npy"], ["--experts", "int4"],
                                  ["--free-gb", "a/cuda0=10"]])
def test_plan_without_fleet_refuses_fleet_only_flags(capsys, flag):
    """The KV-pool table printed as if the flag had been applied (it was ignored: a
    missing --usage file was not even read)."""
    code, err = run_cli(capsys, "plan", "--model-config", str(CARD), "--ctx", "1024", *flag)
    assert code == 2
    assert f"{flag[0]} applies to a fleet plan" in err and "--config" in err


def test_plan_given_a_job_config_points_at_its_fleet(capsys):
    """`kvfleet plan --config configs/sharded.yaml` listed the job's fields as 'Extra inputs
    are not permitted' and 'nodes: Field required'."""
    code, err = run_cli(capsys, "plan", "--config", str(ROOT / "configs" / "sharded.yaml"))
    assert code == 2
    assert "is a job config (kvfleet generate --config), not a fleet file" in err
    assert "configs/fleets/local-sharded.yaml" in err
    code, err = run_cli(capsys, "plan", "--config", str(ROOT / "configs" / "generate.yaml"))
    assert code == 2 and "is a job config" in err and "no workers.fleet" in err


# -- bench attention ----------------------------------------------------------------------
def test_bench_attention_cuda_without_cupy(capsys, monkeypatch):
    """The default backend on a machine without CuPy was a ModuleNotFoundError traceback."""
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    code, err = run_cli(capsys, "bench", "attention", "--shapes", "1x16", "--repeat", "1")
    assert code == 2
    assert "--backend cuda needs CuPy" in err and "--backend cpu" in err


def test_bench_attention_cpu_says_how_t_was_divided(capsys):
    """--shapes 1x256 printed rows of 1x16 with nothing saying why."""
    assert main(["bench", "attention", "--backend", "cpu", "--shapes", "1x256", "--heads", "4",
                 "--tiers", "f32", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "T divided by --cpu-divide 64 (1x256 -> 1x16)" in out and "no floor" in out
    assert main(["bench", "attention", "--backend", "cpu", "--shapes", "1x256", "--heads", "4",
                 "--tiers", "f32", "--repeat", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["cpu_divide"] == 64 and doc["rows"][0]["T"] == 16


@pytest.mark.parametrize("bench,broken", [
    (b, k) for b in ("codecs", "quality") for k in ("no_weights", "truncated_weights", "bad_config")
] + [("quality", "no_tokenizer")])  # (bench codecs reads no tokenizer)
def test_bench_model_with_a_broken_checkpoint_names_the_flag(tiny, tmp_path, capsys, bench,
                                                            broken):
    """A WeightsError / ConfigError / TokenizerError traceback, exit 1 (score and generate
    said it in one line, exit 2)."""
    d = tmp_path / broken
    d.mkdir()
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        (d / f).write_bytes((tiny / f).read_bytes())
    if broken == "no_weights":
        (d / "model.safetensors").unlink()
    elif broken == "truncated_weights":
        data = (tiny / "model.safetensors").read_bytes()
        (d / "model.safetensors").write_bytes(data[: len(data) * 9 // 10])
    elif broken == "bad_config":
        (d / "config.json").write_text('{"hidden_size": 64,')
    else:
        (d / "tokenizer.json").unlink()
    extra = (["--rows", "2", "--tokens", "16", "--heads", "1", "--repeat", "1"] if bench == "codecs"
             else ["--items", "1", "--contexts", "32"])
    code, err = run_cli(capsys, "bench", bench, "--model", str(d), *extra)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"kvfleet bench: error: --model {d}: {d}")


# -- soak ---------------------------------------------------------------------------------
SOAK = ROOT / "configs" / "soak"


def test_soak_with_no_prompts_is_refused(tmp_path, capsys):
    """It ran a round that served nothing and printed 'gate passed' (exit 0)."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    out = tmp_path / "soak"
    code, err = run_cli(capsys, "soak", "--config", str(SOAK / "f32.yaml"), "--prompts",
                        str(empty), "--rounds", "1", "--out", str(out))
    assert code == 2 and f"--prompts {empty}: no requests in it" in err
    assert not out.exists()


def test_soak_missing_arm_file_names_its_flag(tmp_path, capsys):
    prompts = write_lines(tmp_path / "p.jsonl", prompt_lines(1))
    for flags, name in ((["--config", str(tmp_path / "a.yaml")], "--config"),
                        (["--config", str(SOAK / "f32.yaml"), "--vs", str(tmp_path / "b.yaml")], "--vs")):
        code, err = run_cli(capsys, "soak", *flags, "--prompts", str(prompts), "--rounds", "1",
                            "--out", str(tmp_path / "soak"))
        assert code == 2 and f"{name} {tmp_path}/" in err and "No such file" in err, err


def test_soak_that_killed_no_worker_says_so(tmp_path, capsys, monkeypatch):
    """With rounds shorter than --kill-worker-every (or one worker), no kill happened and the
    soak printed 'gate passed' alone: a fault test that tested no recovery."""
    import cluster.soak.runner as runner
    prompts = write_lines(tmp_path / "p.jsonl", prompt_lines(1))
    seen = {}

    def fake_run_soak(plan):
        seen["kill_every_s"] = plan.kill_every_s
        return {"rounds": 1, "faults": {"kills": 0}, "gate": {"passed": True, "failures": []}}, 0
    monkeypatch.setattr(runner, "run_soak", fake_run_soak)
    argv = ["soak", "--config", str(SOAK / "f32.yaml"), "--prompts", str(prompts), "--rounds", "1",
            "--out", str(tmp_path / "soak")]
    code, err = run_cli(capsys, *argv, "--kill-worker-every", "20s")
    assert code == 0 and seen["kill_every_s"] == 20.0
    assert "--kill-worker-every 20s killed no worker" in err
    code, err = run_cli(capsys, *argv)  # no injector asked for: nothing to say
    assert code == 0 and "killed no worker" not in err
    # kills only after their round's last step (cluster/soak/runner.classify_kills) tested
    # no recovery either: the same warning, which says so
    monkeypatch.setattr(runner, "run_soak", lambda plan: (
        {"rounds": 1, "faults": {"kills": 0, "kills_after_end": 3},
         "gate": {"passed": True, "failures": []}}, 0))
    code, err = run_cli(capsys, *argv, "--kill-worker-every", "20s")
    assert code == 0 and "--kill-worker-every 20s killed no worker that a round's job found " \
        "dead: of its kills, 3 landed after their round's last step, which tests no recovery" \
        in err, err
    # kills of idle workers that the job never found (classify_kills: unseen) neither
    monkeypatch.setattr(runner, "run_soak", lambda plan: (
        {"rounds": 1, "faults": {"kills": 2, "kills_unseen": 2, "kills_after_end": 0},
         "gate": {"passed": True, "failures": []}}, 0))
    code, err = run_cli(capsys, *argv, "--kill-worker-every", "20s")
    assert code == 0 and "of its kills, 2 killed an idle worker that the job never stepped " \
        "again, which tests no recovery" in err, err
    monkeypatch.setattr(runner, "run_soak", lambda plan: (
        {"rounds": 1, "faults": {"kills": 2, "kills_unseen": 1, "kills_after_end": 0},
         "gate": {"passed": True, "failures": []}}, 0))
    code, err = run_cli(capsys, *argv, "--kill-worker-every", "20s")  # one was found: silent
    assert code == 0 and "killed no worker" not in err, err


def test_plan_fleet_file_with_a_typo_keeps_its_own_error(tmp_path, capsys):
    """A fleet file whose `nodes` is misspelt shares only `model` (and `plan`) with a job
    config: it was told it 'is a job config (and not a valid one)', hiding the missing
    `nodes` and the unknown key."""
    f = tmp_path / "fleet.yaml"
    f.write_text("model: ../models/x\nplan: {ctx: 4096}\nnode:\n  - {name: host, kind: cpu, memory: 4}\n")
    code, err = run_cli(capsys, "plan", "--config", str(f))
    assert code == 2 and "is a job config" not in err
    assert "nodes" in err and "node" in err.replace("nodes", ""), err


# -- Ctrl-C -------------------------------------------------------------------------------
def test_ctrl_c_is_one_line_and_exit_130(tmp_path):
    """Ctrl-C printed a KeyboardInterrupt traceback and exited 1. Here a real SIGINT reaches
    `kvfleet plan` while it is blocked reading its --config (a FIFO nobody writes to)."""
    import os
    import signal
    import subprocess
    import time
    fifo = tmp_path / "fleet.yaml"
    os.mkfifo(fifo)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen([sys.executable, "-m", "cluster", "plan", "--config", str(fifo)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:  # a FIFO opens for writing (non-blocking) only once its reader has it open
            try:
                w = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
                time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        os.close(w)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err == "kvfleet plan: interrupted\n" and out == ""


def test_ctrl_c_says_what_the_command_kept(tmp_path, capsys, monkeypatch):
    """A command's `interrupted` note is the rest of that one line (soak: its finished
    rounds); the interrupt unwinds the command first (its `finally` blocks run)."""
    import cluster.soak.runner as runner
    unwound = []

    def interrupted(plan):
        try:
            raise KeyboardInterrupt
        finally:
            unwound.append(plan.out)
    monkeypatch.setattr(runner, "run_soak", interrupted)
    prompts = write_lines(tmp_path / "p.jsonl", prompt_lines(2))
    arm = tmp_path / "a.yaml"
    arm.write_text(f"model: {ROOT / 'models' / 'kvfleet-mini'}\n")
    code, err = run_cli(capsys, "soak", "--config", str(arm), "--prompts", str(prompts),
                        "--rounds", "1", "--out", str(tmp_path / "soak"))
    assert code == 130 and unwound == [tmp_path / "soak"]
    assert err == (f"kvfleet soak: interrupted; no round had finished: nothing was kept, and "
                   f"--out {tmp_path / 'soak'} can be given again\n")


def test_generate_stats_written_in_part_leave_the_old_file_whole(tmp_path):
    """write_text truncated the old --stats and wrote over it: a run killed (or a disk
    filled) mid-write left a cut JSON, which `kvfleet soak` read as the round's. Now a
    temporary file beside it is renamed over it, and a write that fails leaves the old file
    and no temporary one."""
    import os
    import subprocess
    stats = tmp_path / "run.stats.json"
    old = {"tokens": 3, "note": "the previous run's"}
    stats.write_text(json.dumps(old))
    code = """\
import resource, signal, sys, types
from pathlib import Path
from cluster.cli import UsageError
from cluster.commands.generate import write_stats
from cluster.scheduler import SchedulerStats
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (a write past the limit fails with EFBIG)
resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.RLIM_INFINITY))
summary = types.SimpleNamespace(
    stats=SchedulerStats(tokens=7, fallbacks={"cpu.x": 2}), done=1, errors=0, runtime_errors=0,
    skipped=0, wall_s=1.0, out="o.parquet",
    workers=[{"rank": i, "note": "\\u00e9<x>" * 16} for i in range(2000)])  # (~400 KB)
try:
    write_stats(summary, types.SimpleNamespace(kv="f32"), Path(sys.argv[1]))
except UsageError as e:
    print(e)
"""
    p = subprocess.run([sys.executable, "-c", code, str(stats)], cwd=ROOT, capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       timeout=120)
    assert p.stdout == (f"--stats {stats}: cannot write it (File too large); the results are in "
                        "o.parquet\n"), p.stderr
    assert json.loads(stats.read_text()) == old
    assert [f.name for f in tmp_path.iterdir()] == [stats.name]
    p = subprocess.run([sys.executable, "-c", code.replace("65536", "1 << 30"), str(stats)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0 and p.stdout == "", p.stderr
    got = json.loads(stats.read_text())
    assert got["tokens"] == 7 and got["fallbacks"] == {"cpu.x": 2} and len(got["workers"]) == 2000
    assert [f.name for f in tmp_path.iterdir()] == [stats.name]
