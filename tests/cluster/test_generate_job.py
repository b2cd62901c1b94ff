"""The generate job on the tiny model: error rows, resume after a limit and after a kill,
and the same results in-process, through the CLI, and on a local Ray started by the job."""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from cluster.config import load_job_config
from cluster.jobs.generate import run_generate, worker_placements
from runtime_helpers import ROOT, job_config, prompt_lines, rows_by_id, write_lines

N = 14


def start_generate(tiny, tmp_path, lines, settings: str):
    """`kvfleet generate` on `lines` in a child process, in-process workers, max_context 64
    and the job settings `settings` (YAML lines): (process with stderr as text, prompts,
    job config, OUT)."""
    prompts = write_lines(tmp_path / "p.jsonl", lines)
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"model: {tiny}\nmax_context: 64\n{settings}workers: {{runtime: inprocess}}\n")
    out = tmp_path / "out.parquet"
    proc = subprocess.Popen([sys.executable, "-m", "cluster", "generate", "--prompts", str(prompts),
                             "--out", str(out), "--config", str(cfg)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return proc, prompts, cfg, out


def config(tiny, **kw):
    return job_config(tiny, flush_every=3, **kw)


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    """One full in-process run of the N standard prompts: id -> row."""
    d = tmp_path_factory.mktemp("ref")
    prompts = write_lines(d / "p.jsonl", prompt_lines(N))
    s = run_generate(config(tiny), prompts, d / "out.parquet", progress=False)
    assert s.done == N and s.errors == 0 and s.skipped == 0
    rows = rows_by_id(d / "out.parquet")
    assert set(rows) == {f"q{i}" for i in range(N)}
    assert all(r["finish_reason"] in ("stop", "length") for r in rows.values())
    assert all(r["completion_token_count"] == len(r["completion_tokens"]) for r in rows.values())
    return rows


def same_completions(rows, reference):
    for k, r in reference.items():
        assert rows[k]["completion_tokens"] == r["completion_tokens"], k
        assert rows[k]["completion"] == r["completion"], k


def test_a_tier_the_models_widths_cannot_use_is_a_config_error(tiny, tmp_path):
    """tq4 / polar need power-of-two latent widths: a model whose kv_lora_rank is not one is
    refused before any worker starts or any row is written (without a fleet too; the
    fleet's placement checks the same), naming the setting and the model's config.json."""
    import shutil
    from cluster.config import JobConfigError
    model = tmp_path / "odd"
    shutil.copytree(tiny, model)
    c = json.loads((model / "config.json").read_text())
    c["kv_lora_rank"] = 48
    (model / "config.json").write_text(json.dumps(c))
    prompts = write_lines(tmp_path / "p.jsonl", prompt_lines(2))
    out = tmp_path / "out.parquet"
    for kv in ("tq4", "polar3"):
        with pytest.raises(JobConfigError, match=rf"kv={kv} \(--kv.*power-of-two.*"
                                                 rf"kv_lora_rank 48.*odd/config.json"):
            run_generate(config(model, kv=kv), prompts, out)
    assert not out.exists() and not list(tmp_path.glob("out.parquet*"))


def test_bad_input_lines_get_error_rows(tiny, tmp_path, reference):
    good = prompt_lines(N)
    bad = {
        2: ('{"id": "m", "prompt": "x"', "malformed JSON"),
        4: (json.dumps({"id": "u", "prompt": "x", "temp": 1}), "unknown field"),
        6: (json.dumps({"id": "e", "prompt": ""}), "empty prompt"),
        8: (json.dumps({"id": "l", "prompt": " ".join(["fox"] * 200)}), "longer than the context"),
        9: (json.dumps({"id": "t", "prompt_tokens": [1, 99999]}), "outside the vocabulary"),
        11: (json.dumps({"id": "q0", "prompt": "again"}), "duplicate id 'q0'"),
        13: (json.dumps({"id": "k", "prompt": "x", "max_tokens": "5"}), "'max_tokens' must be int"),
        15: ("[1, 2]", "expected a JSON object"),
        # out of range for the samplers' uint64 / the pool's int32 (were OverflowErrors that
        # ended the job)
        16: (json.dumps({"id": "s", "prompt": "x", "seed": 2 ** 64}), "'seed'="),
        17: (json.dumps({"id": "b", "prompt_tokens": [1, 2 ** 63]}), "'prompt_tokens' must be"),
        # the id of line 13, which was an error itself (its row used to be merged away)
        18: (json.dumps({"id": "k", "prompt": "x"}), "duplicate id 'k' (first on line 13)"),
        19: (json.dumps({"id": "#line2", "prompt": "x"}), "is reserved"),  # line 2's key
        20: (json.dumps({"id": "f", "prompt": "x", "stop": 0}), "'stop' must be"),
        # an int past float range (was an OverflowError that ended the job)
        21: (json.dumps({"id": "h", "prompt": "x", "temperature": 10 ** 400}), "'temperature'="),
        # lone surrogate escapes (were a TypeError from the tokenizer, or a part file that
        # could not be written, both ending the job)
        22: (json.dumps({"id": "v", "prompt": "x\ud800y"}), "lone surrogate"),
        23: (json.dumps({"id": "w\udc00", "prompt": "x"}), "lone surrogate"),
        # JSON that Python's parser refuses (a ValueError and a RecursionError that ended
        # the job): an int of 5000 digits, arrays nested 100000 deep
        24: ('{"id": "d", "prompt": "x", "max_tokens": ' + "9" * 5000 + "}",
             "cannot read its JSON: Exceeds the limit"),
        25: ('{"id": "n", "prompt": "x", "stop": ' + "[" * 100000 + "]" * 100000 + "}",
             "nested too deeply"),
        # past float32's range, which the samplers take: was inf there (uniform draws)
        26: (json.dumps({"id": "i", "prompt": "x", "temperature": 1e300}), "'temperature'=1e+300"),
        27: (json.dumps({"id": "j", "prompt": "x", "temperature": 3.41e38}), "at most 3.402823e+38"),
    }
    lines = list(good)
    for at in sorted(bad):  # 1-based line numbers in the final file
        lines.insert(at - 1, bad[at][0])
    prompts = write_lines(tmp_path / "p.jsonl", lines)
    out = tmp_path / "out.parquet"
    s = run_generate(config(tiny), prompts, out, progress=False)
    table = pq.read_table(out)
    assert table.num_rows == len(lines) and s.errors == len(bad)
    assert table.column("line").to_pylist() == list(range(1, len(lines) + 1))
    rows = {r["line"]: r for r in table.to_pylist()}
    for at, (_, reason) in bad.items():
        r = rows[at]
        assert r["finish_reason"] == "error" and reason in r["error"], (at, r["error"])
        assert r["error"].startswith(f"line {at}:") and r["completion_tokens"] == []
    ok = {r["id"]: r for r in rows.values() if r["line"] not in bad}
    assert all(r["error"] is None for r in ok.values())
    same_completions(ok, reference)  # the bad lines changed nothing for the good ones


def test_line_that_is_not_utf8_is_an_error_not_a_changed_prompt(tmp_path):
    """A byte that is not UTF-8 (here latin-1's e-acute) was replaced by U+FFFD and the
    changed prompt generated as if the user had written it."""
    from cluster.requests import InputError, Request, read_requests
    p = tmp_path / "p.jsonl"
    p.write_bytes(b'{"id": "a", "prompt": "caf\xe9"}\n{"id": "b", "prompt": "caf\xc3\xa9"}\n')
    a, b = read_requests(p)
    assert isinstance(a, InputError) and a.error == "line 1: not valid UTF-8 text (at column 27)"
    assert a.id is None and a.prompt is None
    assert isinstance(b, Request) and b.prompt == "caf\u00e9"


def test_byte_order_mark_at_the_start_is_skipped_elsewhere_data(tmp_path):
    """A prompts file that starts with a UTF-8 BOM (Windows tools write one) made line 1 an
    error row ('Unexpected UTF-8 BOM'). Only the file's first three bytes are skipped: a
    U+FEFF inside a prompt is kept, a later line that starts with one is still an error,
    and the line numbers (blank lines counted) do not move."""
    from cluster.requests import InputError, Request, read_requests, request_digest
    bom = b"\xef\xbb\xbf"
    body = (b'{"id": "a", "prompt": "caf\xc3\xa9", "seed": 7}\n\n'
            b'{"id": "b", "prompt": "x' + bom + b'y"}\n' + bom + b'{"id": "c", "prompt": "z"}\n'
            b'{"id": "d", "prompt": "caf\xe9"}\n')
    plain, marked = tmp_path / "plain.jsonl", tmp_path / "bom.jsonl"
    plain.write_bytes(body)
    marked.write_bytes(bom + body)
    got, want = list(read_requests(marked)), list(read_requests(plain))
    assert got == want  # the same requests, lines, errors and columns as without the BOM
    a, b, c, d = got
    assert isinstance(a, Request) and (a.id, a.line, a.prompt) == ("a", 1, "caf\u00e9")
    assert isinstance(b, Request) and (b.line, b.prompt) == (3, "x\ufeffy")
    assert isinstance(c, InputError) and c.error.startswith("line 4: malformed JSON: Unexpected")
    assert isinstance(d, InputError) and d.error == "line 5: not valid UTF-8 text (at column 27)"
    assert [request_digest(r) for r in (a, b)] == [request_digest(r) for r in want[:2]]
    # a file that only starts like a BOM keeps its bytes (no byte of it is dropped)
    (tmp_path / "half.jsonl").write_bytes(bom[:2] + b'{"id": "e", "prompt": "q"}\n')
    (e,) = read_requests(tmp_path / "half.jsonl")
    assert isinstance(e, InputError) and e.error == "line 1: not valid UTF-8 text (at column 1)"


def test_rerun_on_the_prompts_saved_with_a_bom_skips_every_row(tiny, tmp_path):
    """Resume treats a BOM-prefixed copy of the prompts as the same file: a run on the plain
    file, then a rerun with the same --out on the copy (re-saved by a Windows editor) has
    nothing to redo; line 1 was an error row that replaced its finished one."""
    lines = prompt_lines(4)
    plain = write_lines(tmp_path / "p.jsonl", lines)
    marked = tmp_path / "bom.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    out = tmp_path / "out.parquet"
    first = run_generate(config(tiny), plain, out, progress=False)
    assert first.done == 4 and first.errors == 0
    before = rows_by_id(out)
    again = run_generate(config(tiny), marked, out, progress=False)
    assert (again.skipped, again.done, again.errors) == (4, 0, 0)
    assert rows_by_id(out) == before


def test_bad_model_dir_is_a_usage_error(tiny, tmp_path):
    """A model dir with a broken config.json or no tokenizer.json is a JobConfigError naming
    the file (kvfleet generate: exit 2, no traceback); they were a ConfigError and a
    TokenizerError that the CLI did not catch."""
    import shutil
    from cluster.config import JobConfigError
    prompts = write_lines(tmp_path / "p.jsonl", prompt_lines(2))
    bad_cfg, no_tok = shutil.copytree(tiny, tmp_path / "m1"), shutil.copytree(tiny, tmp_path / "m2")
    (bad_cfg / "config.json").write_text('{"model_type": "deepseek_v3"}')
    (no_tok / "tokenizer.json").unlink()
    for model, match in ((bad_cfg, "missing required field 'vocab_size'"),
                         (no_tok, "no tokenizer.json")):
        with pytest.raises(JobConfigError, match=f"^model: {model}/.*{match}"):
            run_generate(config(model), prompts, tmp_path / "out.parquet", progress=False)


def test_bad_weights_are_a_usage_error_before_any_worker_starts(tiny, tmp_path, capsys):
    """A model dir whose weights are missing, cut short (an interrupted download) or of
    another shape is one line naming the file, exit 2, with nothing written; the workers
    found it as they loaded, each with a traceback (exit 1; through Ray "all 1 worker
    actors died while starting")."""
    import shutil
    from cluster.cli import main
    prompts = write_lines(tmp_path / "p.jsonl", prompt_lines(2))
    cut, gone, other = (shutil.copytree(tiny, tmp_path / n) for n in ("cut", "gone", "other"))
    weights = cut / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    (gone / "model.safetensors").unlink()
    c = json.loads((other / "config.json").read_text())
    c["moe_intermediate_size"] *= 2  # (the same tensors, other shapes than the config's)
    (other / "config.json").write_text(json.dumps(c))
    job = tmp_path / "job.yaml"
    job.write_text("workers: {runtime: inprocess}\n")
    for model, said in ((cut, f"{weights}: truncated safetensors file"),
                        (gone, f"{gone}: no model.safetensors"),
                        (other, f"{other / 'model.safetensors'}: tensor .* has shape")):
        out = tmp_path / f"{model.name}.parquet"
        assert main(["generate", "--prompts", str(prompts), "--out", str(out), "--config",
                     str(job), "--model", str(model)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        assert re.search(f"^kvfleet generate: error: model: {said}", err), err
        assert not list(tmp_path.glob(f"{model.name}.parquet*"))


def test_a_driver_without_the_weights_leaves_their_check_to_the_ray_workers(tiny, tmp_path,
                                                                             monkeypatch, caplog):
    """A `ray job submit` driver on a head node that has config.json and the tokenizer but
    not the weights (they are on the GPU nodes, which load their own copy): the check before
    the workers start refused it (exit 2), which no job could run past. Now it warns and
    goes on to start the workers; weights that are here are still checked."""
    import shutil

    import cluster.jobs.generate as gen
    from cluster.cli import main
    prompts = write_lines(tmp_path / "p.jsonl", prompt_lines(2))
    gone, cut = shutil.copytree(tiny, tmp_path / "gone"), shutil.copytree(tiny, tmp_path / "cut")
    (gone / "model.safetensors").unlink()
    with open(cut / "model.safetensors", "r+b") as f:
        f.truncate(1000)

    class Started(Exception):
        pass

    def start(cfg):
        raise Started(cfg.model)
    monkeypatch.setattr(gen, "_start_workers", start)
    job = tmp_path / "job.yaml"
    job.write_text("workers: {runtime: ray}\n")
    with caplog.at_level(logging.WARNING), pytest.raises(Started):
        main(["generate", "--prompts", str(prompts), "--out", str(tmp_path / "o.parquet"),
              "--config", str(job), "--model", str(gone)])
    assert f"model: {gone} has no weights on this host" in caplog.text
    assert main(["generate", "--prompts", str(prompts), "--out", str(tmp_path / "c.parquet"),
                 "--config", str(job), "--model", str(cut)]) == 2


def test_unreadable_or_foreign_out_is_a_usage_error(tmp_path):
    """An --out that is not a kvfleet results file is a JobConfigError naming it (exit 2);
    it was a RuntimeError, a traceback from the CLI."""
    import pyarrow as pa
    from cluster.config import JobConfigError
    from cluster.jobs.results_store import ResultStore
    corrupt, foreign = tmp_path / "corrupt.parquet", tmp_path / "foreign.parquet"
    corrupt.write_bytes(b"not parquet")
    pq.write_table(pa.table({"x": [1]}), foreign)
    with pytest.raises(JobConfigError, match=f"{corrupt}: cannot read earlier results"):
        ResultStore(corrupt).done_keys()
    with pytest.raises(JobConfigError, match=f"{foreign}: not a kvfleet results file"):
        ResultStore(foreign).done_keys()


def test_resume_after_limit_skips_done_ids(tiny, tmp_path, reference):
    prompts = write_lines(tmp_path / "p.jsonl", prompt_lines(N))
    out = tmp_path / "out.parquet"
    first = run_generate(config(tiny), prompts, out, limit=5, progress=False)
    assert first.done == 5 and set(rows_by_id(out)) == {f"q{i}" for i in range(5)}
    second = run_generate(config(tiny), prompts, out, progress=False)
    assert second.skipped == 5 and second.done == N - 5  # nothing redone
    rows = rows_by_id(out)
    assert pq.read_table(out).num_rows == N and not (tmp_path / "out.parquet.parts").exists()
    same_completions(rows, reference)
    third = run_generate(config(tiny), prompts, out, progress=False)
    assert third.skipped == N and third.done == 0 and pq.read_table(out).num_rows == N


@pytest.mark.slow
def test_killed_job_keeps_its_parts_and_resumes(tiny, tmp_path, reference):
    """kill -9 the CLI half-way: the finished part files survive; a rerun completes the rest
    without redoing them."""
    lines = prompt_lines(N) + prompt_lines(30, seed=1, max_tokens=20)[N:]  # a longer tail
    prompts = write_lines(tmp_path / "p.jsonl", lines)
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"model: {tiny}\nslots: 2\nmax_context: 64\nflush_every: 2\n"
                   "workers: {runtime: inprocess}\n")
    out = tmp_path / "out.parquet"
    parts = tmp_path / "out.parquet.parts"
    proc = subprocess.Popen([sys.executable, "-m", "cluster", "generate", "--prompts", str(prompts),
                             "--out", str(out), "--config", str(cfg)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if parts.exists() and len(list(parts.glob("part-*.parquet"))) >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    done_before = sum(pq.read_table(p).num_rows for p in parts.glob("part-*.parquet"))
    assert 6 <= done_before < len(lines)
    s = run_generate(load_job_config(cfg, env={}), prompts, out, progress=False)
    assert s.skipped == done_before and s.done == len(lines) - done_before
    table = pq.read_table(out)
    ids = table.column("id").to_pylist()
    assert sorted(ids) == sorted(json.loads(x)["id"] for x in lines)  # each id once
    rows = rows_by_id(out)
    assert all(r["finish_reason"] != "error" for r in rows.values())
    for k, r in reference.items():  # slots 2 here vs 4 there: same greedy tokens
        assert rows[k]["completion_tokens"] == r["completion_tokens"], k


@pytest.mark.slow
def test_a_second_run_on_the_same_out_is_refused(tiny, tmp_path):
    """Two runs writing one OUT at once (a `ray job submit` resubmitted while the first still
    runs: a Ctrl-C of the submitting client does not stop a job) numbered their parts alike
    and removed each other's: one of them failed at its end (a part being replaced, a part
    gone, a parts folder not empty). The second is refused while the first runs, and the OUT
    is free again once the first has ended, however it ended."""
    from cluster.config import JobConfigError
    lines = prompt_lines(40, seed=4, max_tokens=20)
    first, prompts, cfg, out = start_generate(tiny, tmp_path, lines, "slots: 1\nflush_every: 1\n")
    parts = tmp_path / "out.parquet.parts"
    try:
        deadline = time.monotonic() + 120
        while first.poll() is None and time.monotonic() < deadline and not (
                parts.exists() and list(parts.glob("part-*.parquet"))):
            time.sleep(0.05)
        assert first.poll() is None, first.stderr.read()[-2000:]
        with pytest.raises(JobConfigError, match=rf"^--out {out}: another kvfleet generate "
                                                 rf"\(pid {first.pid}\) is writing it"):
            run_generate(load_job_config(cfg, env={}), prompts, out, progress=False)
    finally:
        first.kill()  # (a SIGKILL: no finally of its own lets go of the lock)
        first.wait()
    # a run that fails part way lets go of it too
    with pytest.raises(JobConfigError, match="--prompts"):
        run_generate(load_job_config(cfg, env={}), tmp_path, out, progress=False)
    s = run_generate(load_job_config(cfg, env={}), prompts, out, progress=False)
    assert s.skipped + s.done == len(lines) and s.skipped > 0
    table = pq.read_table(out)
    assert sorted(table.column("id").to_pylist()) == sorted(json.loads(x)["id"] for x in lines)
    assert not (tmp_path / "out.parquet.lock").exists()


@pytest.mark.slow
@pytest.mark.parametrize("sig, code, said", [
    (signal.SIGTERM, 143, "stopped by SIGTERM"),
    (signal.SIGINT, 130, "interrupted; the finished rows are kept (in ")])
def test_a_stop_signal_keeps_the_finished_rows(tiny, tmp_path, sig, code, said):
    """SIGTERM (`ray job stop`, kill, a preempted node) ended the job at once: the rows it
    had finished but not yet flushed (up to flush_every of them) were lost. Now it stops as
    Ctrl-C does: the finished rows go to the part files, the exit code is 143 and a line
    says how to resume; a rerun skips every row that had been reported done. Ctrl-C
    (SIGINT) likewise, with exit 130 and the same line (it printed a traceback)."""
    import re
    lines = prompt_lines(60, seed=3, max_tokens=12)
    proc, prompts, cfg, out = start_generate(tiny, tmp_path, lines,
                                             "slots: 2\nflush_every: 1000\nprogress_every_s: 0.001\n")
    reported, err = 0, []
    for line in proc.stderr:
        err.append(line)
        m = re.search(r"progress: (\d+)/", line)
        if m and int(m.group(1)) >= 4:
            reported = int(m.group(1))
            os.kill(proc.pid, sig)
            break
    err += proc.stderr.readlines()
    assert proc.wait(timeout=60) == code, "".join(err)[-3000:]
    assert reported and not out.exists()
    assert said in "".join(err) and "Traceback" not in "".join(err)
    parts = list((tmp_path / "out.parquet.parts").glob("part-*.parquet"))
    kept = sum(pq.read_table(p).num_rows for p in parts)
    assert reported <= kept < len(lines)
    s = run_generate(load_job_config(cfg, env={}), prompts, out, progress=False)
    assert s.skipped == kept and pq.read_table(out).num_rows == len(lines)


@pytest.mark.slow
def test_cli_on_a_local_ray_matches_in_process(tiny, tmp_path, reference):
    """`python -m cluster generate` without RAY_ADDRESS starts its own Ray (and turns auth
    off when RAY_AUTH_MODE is unset), places the worker actor by a custom resource."""
    prompts = write_lines(tmp_path / "p.jsonl", prompt_lines(N))
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"model: {tiny}\nslots: 4\nmax_context: 64\nprefill_chunk: 16\n"
                   "workers: {count: 2, ray_num_cpus: 2, num_cpus: 1, resources: {cpu_worker: 1}}\n")
    out = tmp_path / "out.parquet"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    p = subprocess.run([sys.executable, "-m", "cluster", "generate", "--prompts", str(prompts),
                        "--out", str(out), "--config", str(cfg)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "RAY_AUTH_MODE was unset" in p.stderr
    assert "starting a local Ray with 2 CPUs and resources {'cpu_worker': 2.0}" in p.stderr
    rows = rows_by_id(out)
    assert len(rows) == N and {r["worker"] for r in rows.values()} == {"worker0", "worker1"}
    same_completions(rows, reference)


def test_worker_placements_use_resources_and_labels(tiny, tmp_path):
    c = config(tiny, workers={"count": 3, "num_cpus": 0.5, "resources": {"cpu_worker": 1},
                              "label_selector": {"kind": "cpu"}})
    pl = worker_placements(c)
    assert [s.name for s, _ in pl] == ["worker0", "worker1", "worker2"]
    assert all(o == {"num_cpus": 0.5, "resources": {"cpu_worker": 1.0},
                     "label_selector": {"kind": "cpu"}} for _, o in pl)
    assert all("num_gpus" not in o for _, o in pl)
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("nodes:\n"
                     "  - {name: a, kind: cpu, devices: 2, memory: 8, slots: 3, "
                     "resources: {cpu_worker: 2}, labels: {zone: x}}\n"
                     "  - {name: g, kind: cuda, devices: 1, memory: 80, slots: 5, resources: {h200: 1}}\n")
    pl = worker_placements(config(tiny, workers={"fleet": str(fleet)}))
    assert [(s.name, s.slots) for s, _ in pl] == [("a/cpu0", 3), ("a/cpu1", 3), ("g/cuda0", 5)]
    assert pl[0][1]["resources"] == {"cpu_worker": 1.0} and pl[0][1]["label_selector"] == {"zone": "x"}
    assert pl[2][1]["num_gpus"] == 1 and pl[2][1]["resources"] == {"h200": 1.0}


def test_resume_after_editing_the_prompts_keeps_one_row_per_current_line(tiny, tmp_path):
    """A fixed duplicate line, then a new first line and a removed id: the merged file has
    exactly the current lines' rows at their current line numbers (stale rows stayed)."""
    out = tmp_path / "out.parquet"
    a, b, c = (json.dumps({"id": i, "prompt": p, "max_tokens": 3})
               for i, p in (("a", "hello"), ("b", "world"), ("c", "fox")))
    dup = json.dumps({"id": "a", "prompt": "world", "max_tokens": 3})
    for lines, want in (([a, dup, c], [("a", 1), (None, 2), ("c", 3)]),
                        ([a, b, c], [("a", 1), ("b", 2), ("c", 3)]),
                        ([c, a], [("c", 1), ("a", 2)])):  # b removed, c moved first
        run_generate(config(tiny), write_lines(tmp_path / "p.jsonl", lines), out, progress=False)
        t = pq.read_table(out)
        assert list(zip(t.column("id").to_pylist(), t.column("line").to_pylist())) == want


def test_a_rerun_that_would_leave_none_of_the_finished_rows_is_refused(tiny, tmp_path, capsys):
    """Rerun on an OUT with an empty prompts file (a failed download, `>` for `>>`), a blank
    one or another batch's ids: finalize keeps only the current lines' rows, so every
    finished row was wiped, exit 0. It is one line naming --out and --prompts, exit 2, OUT
    unchanged. An OUT of error rows alone (nothing finished to lose) is no reason to refuse."""
    from cluster.cli import main
    job = tmp_path / "job.yaml"
    job.write_text(f"model: {tiny}\nmax_context: 64\nworkers: {{runtime: inprocess}}\n")
    out = tmp_path / "out.parquet"

    def gen(prompts: Path) -> int:
        return main(["generate", "--prompts", str(prompts), "--out", str(out), "--config", str(job)])

    assert gen(write_lines(tmp_path / "p.jsonl", prompt_lines(3))) == 0
    before = out.read_bytes()
    capsys.readouterr()
    other = write_lines(tmp_path / "other.jsonl", [json.dumps({"id": "z", "prompt": "fox"})])
    for prompts in (write_lines(tmp_path / "empty.jsonl", []),
                    write_lines(tmp_path / "blank.jsonl", ["", "  \t", ""]), other):
        assert gen(prompts) == 2, prompts
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        assert (f"--out {out}: holds 3 finished rows" in err and f"--prompts {prompts}" in err
                and "move" in err), err
        assert out.read_bytes() == before and not list(tmp_path.glob("out.parquet.*"))
    errors_only = tmp_path / "errors.parquet"
    bad = write_lines(tmp_path / "bad.jsonl", [json.dumps({"prompt": "no id"})])
    for prompts, rows in ((bad, [None]), (other, ["z"])):
        assert main(["generate", "--prompts", str(prompts), "--out", str(errors_only),
                     "--config", str(job)]) == 0
        assert pq.read_table(errors_only).column("id").to_pylist() == rows


def test_resume_redoes_a_line_whose_request_changed(tiny, tmp_path):
    """An id whose prompt or per-line settings were edited since its row was made is run
    again (its old row, for the old request, was kept as done: the output's prompt and
    completion did not belong to the prompts file any more); an unchanged id is skipped."""
    out = tmp_path / "out.parquet"
    line = lambda i, p, **kw: json.dumps({"id": i, "prompt": p, "max_tokens": 3, **kw})
    run_generate(config(tiny), write_lines(tmp_path / "p.jsonl", [
        line("a", "the quick fox"), line("b", "lazy dog"), line("c", "cache expert"),
        line("d", "latent slot")]), out, progress=False)
    edited = [line("a", "answer question Paris"), line("b", "lazy dog", max_tokens=5),
              line("c", "cache expert"), line("d", "latent slot", stop=["zz"])]
    s = run_generate(config(tiny), write_lines(tmp_path / "p.jsonl", edited), out, progress=False)
    assert s.skipped == 1 and s.done == 3
    fresh = tmp_path / "fresh.parquet"
    run_generate(config(tiny), tmp_path / "p.jsonl", fresh, progress=False)
    got, want = rows_by_id(out), rows_by_id(fresh)
    for k in "abcd":
        assert got[k]["prompt"] == want[k]["prompt"], k
        assert got[k]["completion_tokens"] == want[k]["completion_tokens"], k
    # a file written before rows carried their request's digest (and so before files had
    # one of their rows): its rows stay done
    t = pq.read_table(out)
    old = {k: v for k, v in t.schema.metadata.items() if k != b"kvfleet.digest"}
    pq.write_table(t.drop_columns(["request_digest"]).replace_schema_metadata(old), out)
    s = run_generate(config(tiny), write_lines(tmp_path / "p.jsonl", [line("a", "fox")] + edited[1:]),
                     out, progress=False)
    assert s.skipped == 4 and s.done == 0


def test_max_context_past_the_models_positions_warns(tiny, tmp_path, caplog):
    """A max_context longer than the model's max_position_embeddings ran positions the model
    was never trained at without a word (vLLM refuses such a max_model_len; `kvfleet plan`
    warns): the job says so once, and runs as configured."""
    limit = json.loads((tiny / "config.json").read_text())["max_position_embeddings"]
    prompts = write_lines(tmp_path / "p.jsonl", prompt_lines(2))
    for ctx, warned in ((limit, False), (limit + 16, True)):
        caplog.clear()
        with caplog.at_level("WARNING"):
            s = run_generate(config(tiny, max_context=ctx), prompts, tmp_path / f"{ctx}.parquet",
                             progress=False)
        assert s.done == 2
        said = f"max_context={ctx} exceeds the model's max_position_embeddings {limit}"
        assert (said in caplog.text) == warned, caplog.text


def test_fallbacks_are_in_the_stats_and_the_log(tiny, tmp_path, caplog):
    """A native path that fell back (polar rows rebuilt to float32 by the numpy attention)
    reached only the kvfleet_fallbacks metric: a job without Ray, its --stats and its log
    said nothing. Now the scheduler's stats count every path, and the first fallback of a
    path is logged once, naming it."""
    prompts = write_lines(tmp_path / "p.jsonl", prompt_lines(5))
    with caplog.at_level("WARNING"):
        s = run_generate(config(tiny, kv="polar3"), prompts, tmp_path / "o.parquet", progress=False)
    assert s.stats.fallbacks.get("cpu.polar_rebuild_rows", 0) > 0
    said = [r for r in caplog.records if "cpu.polar_rebuild_rows" in r.getMessage()]
    assert len(said) == 1 and "fell back" in said[0].getMessage()
    s = run_generate(config(tiny, kv="kv8"), prompts, tmp_path / "k.parquet", progress=False)
    assert s.stats.fallbacks == {}


def test_resume_with_other_settings_is_refused(tiny, tmp_path):
    """One OUT never mixes two configurations' rows (a rerun with another --kv used to
    add tq4 rows beside the f32 ones and call the rest done)."""
    from cluster.config import JobConfigError
    prompts = write_lines(tmp_path / "p.jsonl", prompt_lines(4))
    out = tmp_path / "out.parquet"
    run_generate(config(tiny), prompts, out, limit=2, progress=False)
    before = pq.read_table(out)
    for kw, field in (({"kv": "tq4"}, "kv 'f32'"), ({"sampling": {"max_tokens": 2}}, "sampling")):
        with pytest.raises(JobConfigError, match=f"holds results made with {field}"):
            run_generate(config(tiny, **kw), prompts, out, progress=False)
    assert pq.read_table(out).equals(before)  # nothing touched
    s = run_generate(config(tiny), prompts, out, progress=False)  # the same settings resume
    assert s.skipped == 2 and pq.read_table(out).num_rows == 4


def test_local_ray_has_a_cpu_for_every_worker(tiny):
    """--workers 3 on a 2-core machine: the local Ray offers 3 CPUs (it waited forever for
    the third actor); a workers.ray_num_cpus too small for them is a config error."""
    from cluster.config import JobConfigError
    from cluster.jobs.generate import local_cpus
    many = os.cpu_count() + 2
    cfg = config(tiny, workers={"count": many})
    assert local_cpus(cfg, worker_placements(cfg)) == many
    cfg = config(tiny, workers={"count": 1})
    assert local_cpus(cfg, worker_placements(cfg)) == os.cpu_count()
    cfg = config(tiny, workers={"count": 3, "ray_num_cpus": 2})
    with pytest.raises(JobConfigError, match="ray_num_cpus=2 is fewer than the 3 CPUs"):
        local_cpus(cfg, worker_placements(cfg))


def test_resume_of_a_file_without_settings_checks_its_tier(tiny, tmp_path):
    """A results file written before settings were recorded: a rerun with another tier is
    refused by its rows' tier column (it was accepted, then stamped with the new settings)."""
    from cluster.config import JobConfigError
    prompts = write_lines(tmp_path / "p.jsonl", prompt_lines(3))
    out = tmp_path / "out.parquet"
    run_generate(config(tiny), prompts, out, limit=2, progress=False)
    old = pq.read_table(out)
    pq.write_table(old.replace_schema_metadata(None), out)  # as an earlier release wrote it
    with pytest.raises(JobConfigError, match=r"holds results of tier \['f32'\]; this run has kv 'kv8'"):
        run_generate(config(tiny, kv="kv8"), prompts, out, progress=False)
    s = run_generate(config(tiny), prompts, out, progress=False)
    assert s.skipped == 2 and pq.read_table(out).num_rows == 3


def test_lines_without_a_seed_sample_apart_and_reproducibly(tiny, tmp_path):
    """Sampled lines without `seed` took the job's seed itself, so the same prompt twice gave
    the same completion. Now each draws with a seed made from the job's and its id: twice the
    same prompt differs, a rerun gives the same rows, a given seed is kept."""
    from cluster.jobs.generate import request_seed
    assert request_seed(0, "a") != request_seed(0, "b") != request_seed(7, "b")
    assert request_seed(7, "b") == request_seed(7, "b") < 2 ** 64
    lines = [json.dumps({"id": f"d{i}", "prompt": "the cluster schedules", "max_tokens": 12,
                         "temperature": 1.5}) for i in range(4)]
    lines.append(json.dumps({"id": "s", "prompt": "the cluster schedules", "max_tokens": 12,
                             "temperature": 1.5, "seed": 0}))
    prompts = write_lines(tmp_path / "p.jsonl", lines)
    runs = []
    for k in range(2):
        run_generate(config(tiny), prompts, tmp_path / f"o{k}.parquet", progress=False)
        runs.append(rows_by_id(tmp_path / f"o{k}.parquet"))
    got = [tuple(runs[0][f"d{i}"]["completion_tokens"]) for i in range(4)]
    assert len(set(got)) > 1, got  # (4 equal completions before)
    assert all(runs[0][k]["completion_tokens"] == runs[1][k]["completion_tokens"] for k in runs[0])


def test_rows_failed_at_run_time_exit_1_and_a_rerun_redoes_them(tiny, tmp_path, capsys,
                                                                monkeypatch, reference):
    """A worker's step raised (its third; the sequences in it fail as error rows): `kvfleet
    generate` still exited 0, so `ray job submit` reported SUCCEEDED for a job whose rows
    were errors. Now it exits 1 and says on stderr how many rows failed at run time, where
    they are and that a rerun redoes them; the summary line and --stats count them apart
    from input errors, which alone still exit 0 (the data's fault, not the job's)."""
    from cluster.cli import main
    from workers.actor import Worker
    lines = prompt_lines(N)
    lines.insert(3, json.dumps({"id": "e", "prompt": ""}))  # line 4: an input error
    prompts = write_lines(tmp_path / "p.jsonl", lines)
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"model: {tiny}\nslots: 4\nmax_context: 64\nprefill_chunk: 16\n"
                   "workers: {runtime: inprocess}\n")
    out, stats = tmp_path / "out.parquet", tmp_path / "stats.json"
    argv = ["generate", "--prompts", str(prompts), "--out", str(out), "--config", str(cfg),
            "--stats", str(stats)]
    step, calls = Worker.step, []

    def failing(self, batch):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return step(self, batch)

    monkeypatch.setattr(Worker, "step", failing)
    code = main(argv)
    monkeypatch.undo()
    std = capsys.readouterr()
    rows = rows_by_id(out)
    broken = sorted(k for k, r in rows.items()
                    if (r["error"] or "").startswith("worker step failed: RuntimeError('CUDA"))
    n = len(broken)
    assert 1 <= n < N and len(rows) == N + 1, rows
    assert code == 1, std.err[-2000:]
    assert (f"kvfleet generate: {n} of {N + 1} rows failed at run time" in std.err
            and f"kept in {out} as error rows" in std.err
            and "a rerun with the same --out runs them again" in std.err), std.err[-2000:]
    assert f"{N + 1} rows ({n + 1} errors, {n} of them at run time, 0 skipped" in std.out
    doc = json.loads(stats.read_text())
    assert doc["runtime_errors"] == n and doc["errors"] == n + 1 and doc["rows"] == N + 1

    code = main(argv)  # the rerun redoes the failed rows (and the input error, again)
    std = capsys.readouterr()
    assert code == 0, std.err[-2000:]
    assert "failed at run time" not in std.err
    assert f"{n + 1} rows (1 errors, 0 of them at run time, {N - n} skipped" in std.out
    rows = rows_by_id(out)
    assert rows["e"]["finish_reason"] == "error" and rows["e"]["error"].startswith("line 4:")
    same_completions(rows, reference)
    assert json.loads(stats.read_text())["runtime_errors"] == 0


@pytest.mark.parametrize("given, warned", [
    ("cache", True),                # relative: made absolute against the job's copy
    ("../cache", True),             # relative too (next to the copy, in Ray's session dir)
    ("{job}/sub/cache", True),      # absolute, inside the copy
    ("{link}/cache", True),         # through a link into the copy
    ("{keep}/cache", False),        # absolute, outside it
])
def test_kv_cache_dir_in_the_jobs_copy_of_the_working_dir_warns(tiny, tmp_path, monkeypatch,
                                                                 caplog, given, warned):
    """Under `ray job submit` the cwd is the job's temporary copy of the working dir: a
    kv_cache_dir there (a relative one lands there) loses the saved KV, as a relative --out
    loses the results, which already warned. Both are said, the cache dir from the flag or
    the variable; outside `ray job submit` nothing is."""
    from cluster.cli import main
    job, keep = tmp_path / "job", tmp_path / "keep"
    job.mkdir()
    (tmp_path / "link").symlink_to(job)
    path = given.format(job=job, keep=keep, link=tmp_path / "link")
    prompts = write_lines(tmp_path / "p.jsonl", prompt_lines(2))
    monkeypatch.chdir(job)
    argv = ["generate", "--prompts", str(prompts), "--model", str(tiny), "--inprocess",
            "--max-tokens", "2", "--out", str(tmp_path / "o.parquet")]
    said = "is relative or lies inside the job's copy of the working dir"
    for job_env, flag in ((True, True), (True, False), (False, True)):
        caplog.clear()
        with monkeypatch.context() as m:
            if job_env:
                m.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")
            if flag:
                args = argv + ["--kv-cache-dir", path]
            else:
                m.setenv("KVFLEET_KV_CACHE_DIR", path)
                args = argv
            with caplog.at_level("WARNING"):
                assert main(args) == 0
        hit = [r.getMessage() for r in caplog.records if said in r.getMessage()]
        assert bool(hit) == (warned and job_env), (job_env, flag, caplog.text)
        assert not hit or f"dir ({Path.cwd()}): under `ray job submit`" in hit[0]
    caplog.clear()
    with monkeypatch.context() as m, caplog.at_level("WARNING"):  # the --out one: as before
        m.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")
        assert main(argv[:-1] + ["o.parquet"]) == 0
    assert "--out o.parquet is relative" in caplog.text
