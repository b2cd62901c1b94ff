"""The soak runner's bookkeeping without Ray or a model: which rows count as served, what a
round's environment holds, a cut round, and a used output directory."""
import json
import math
import subprocess

import pandas as pd
import pytest

from cluster.cli import UsageError
from cluster.soak import runner
from cluster.soak.config import JOB_ENV, load_arm


def _prompts(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text("\n".join([
        json.dumps({"id": "a", "prompt": "x"}),
        '{"id": "m", "prompt": ',                            # malformed: keyed by its line
        json.dumps({"id": "a", "prompt": "again"}),          # duplicate id: keyed by its line
        json.dumps({"id": "b", "prompt": "x\u2028y"}),       # one line despite U+2028
    ]) + "\n", encoding="utf-8")
    return p


def _results(rows, tmp_path):
    path = tmp_path / "r.parquet"
    pd.DataFrame([{"ttft_s": 0.1, "decode_tokens_per_s": 10.0, **r} for r in rows]).to_parquet(path)
    return path


def test_input_error_rows_count_as_served(tmp_path):
    expected = runner._expected_keys(_prompts(tmp_path))
    assert expected == {"a", "#line2", "#line3", "b"}
    rows = [{"id": "a", "line": 1, "finish_reason": "length", "error": None},
            {"id": None, "line": 2, "finish_reason": "error", "error": "line 2: malformed JSON"},
            {"id": None, "line": 3, "finish_reason": "error", "error": "line 3: duplicate id 'a'"},
            {"id": "b", "line": 4, "finish_reason": "stop", "error": None}]
    meta = {"round": 0, "arm": "A", "label": "A", "start_s": 0.0, "end_s": 1.0,
            "returncode": "0", "parquet": _results(rows, tmp_path), "stats": tmp_path / "none"}
    row, _ = runner._round_rows(meta, expected)
    assert row["lost_requests"] == 0 and row["errors"] == 2
    meta["parquet"] = _results(rows[:1] + rows[2:], tmp_path)  # line 2's row missing
    assert runner._round_rows(meta, expected)[0]["lost_requests"] == 1


def _arm(tmp_path):
    cfg = tmp_path / "arm.yaml"
    cfg.write_text("kv: tq4\nslots: 2\n")
    return load_arm(cfg)


def test_round_env_keeps_the_arms_config(tmp_path, monkeypatch):
    """KV8 / KVFLEET_SLOTS in the soak's environment would override both arms alike."""
    seen = {}

    def fake_run(cmd, env, **kw):
        seen.update(env)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(runner.subprocess, "run", fake_run)
    monkeypatch.setenv("KV8", "1")
    monkeypatch.setenv("KVFLEET_SLOTS", "8")
    monkeypatch.setenv("KVFLEET_KEEP_ME", "yes")
    (tmp_path / "rounds").mkdir()
    plan = runner.SoakPlan(arms=[_arm(tmp_path)], prompts=_prompts(tmp_path), out=tmp_path)
    meta = runner._run_round(plan, plan.arms[0], 0, "127.0.0.1:1", timeout=60.0)
    assert meta["returncode"] == "0"
    assert "KV8" not in seen and "KVFLEET_SLOTS" not in seen and seen["KVFLEET_KEEP_ME"] == "yes"
    assert seen["RAY_ADDRESS"] == "127.0.0.1:1"


def test_a_started_round_may_run_past_the_duration_but_a_hang_is_a_timeout(tmp_path, monkeypatch):
    """The last round of a --duration soak gets twice the longest earlier round even when the
    duration is spent (it was killed and its requests counted lost); a round that takes
    longer than its limit is a timeout, whose rows then count as lost (not dropped)."""
    plan = runner.SoakPlan(arms=[_arm(tmp_path)], prompts=_prompts(tmp_path), out=tmp_path,
                           round_timeout_s=600.0)
    now = runner.time.monotonic()
    assert runner.round_timeout(plan, now + 1e6, []) == 600.0  # first round: its own limit
    assert runner.round_timeout(plan, now + 5, [40.0, 70.0]) == pytest.approx(140.0)
    assert runner.round_timeout(plan, now + 300, [40.0]) == pytest.approx(300.0, abs=1.0)
    assert runner.round_timeout(plan, now - 50, [400.0]) == 600.0

    def fake_run(cmd, timeout, **kw):
        raise subprocess.TimeoutExpired(cmd, timeout)

    monkeypatch.setattr(runner.subprocess, "run", fake_run)
    (tmp_path / "rounds").mkdir()
    meta = runner._run_round(plan, plan.arms[0], 0, "x", timeout=1.0)
    assert meta["returncode"] == "timeout"
    row, _ = runner._round_rows(meta, runner._expected_keys(plan.prompts))
    assert row["lost_requests"] == 4  # nothing was served: every line is lost


def test_used_output_directory_is_refused(tmp_path):
    out = tmp_path / "soak"
    (out / "rounds").mkdir(parents=True)
    (out / "rounds" / "r000_A.parquet").write_bytes(b"old")
    plan = runner.SoakPlan(arms=[_arm(tmp_path)], prompts=_prompts(tmp_path), out=out, rounds=1)
    with pytest.raises(UsageError, match="not a new or empty directory"):
        runner.run_soak(plan)
    assert (out / "rounds" / "r000_A.parquet").read_bytes() == b"old"  # nothing touched


def test_ratio_gauge_is_set_again_until_stopped(monkeypatch):
    """Ray exports a gauge ~20 s after its last set; a round pair takes minutes, so the
    last ratios are set again every every_s (the dashboard panel was empty most of the time)."""
    import time as _time

    import ray.util.metrics

    sets = []

    class FakeGauge:
        def __init__(self, *a, **kw):
            pass

        def set(self, value, tags):
            sets.append((tags["metric"], value))

    monkeypatch.setattr(ray.util.metrics, "Gauge", FakeGauge)
    g = runner.RatioGauge(every_s=0.02)
    g.publish({"throughput_tok_s": 100.0, "kv_bytes": 0}, {"throughput_tok_s": 97.0, "kv_bytes": 5})
    _time.sleep(0.2)
    g.stop()
    n = len(sets)
    assert n >= 4 and set(sets) == {("throughput_tok_s", 0.97)}  # (a zero A is left out)
    _time.sleep(0.1)
    assert len(sets) == n  # stopped
    # a later round without a usable A value: NaN (a gap), never the earlier round's ratio
    for a in ({}, {"throughput_tok_s": 0.0}, {"throughput_tok_s": float("nan")}):
        sets.clear()
        g.publish(a, {"throughput_tok_s": 90.0})
        assert len(sets) == 1 and sets[0][0] == "throughput_tok_s" and math.isnan(sets[0][1])
    g.publish({"throughput_tok_s": 100.0}, {"throughput_tok_s": 90.0})
    assert sets[-1] == ("throughput_tok_s", 0.9)
    # a pair where either run failed: its figures are partial, so no ratio (it was 60/100)
    for a, b in (({"failed": False}, {"failed": True}), ({"failed": True}, {"failed": False})):
        sets.clear()
        g.publish({"throughput_tok_s": 100.0, **a}, {"throughput_tok_s": 60.0, **b})
        assert len(sets) == 1 and sets[0][0] == "throughput_tok_s" and math.isnan(sets[0][1])
    g.publish({"throughput_tok_s": 100.0, "failed": False}, {"throughput_tok_s": 95.0, "failed": False})
    assert sets[-1] == ("throughput_tok_s", 0.95)


def test_a_killed_round_keeps_the_rows_it_had_flushed(tmp_path):
    """A round killed at its timeout never merges OUT: its served rows are in OUT.parts/. They
    counted as lost (every line) and were left out of requests.parquet."""
    from cluster.jobs.results_store import ResultStore
    from cluster.requests import Result
    prompts = _prompts(tmp_path)
    out = tmp_path / "r000_A.parquet"
    store = ResultStore(out, flush_every=1)
    store.add(Result(id="a", line=1, finish_reason="error", error="worker died"))
    store.add(Result(id="a", line=1, completion_tokens=[1], finish_reason="length", ttft_s=0.1))
    store.add(Result(id="b", line=4, completion_tokens=[2], finish_reason="stop", ttft_s=0.2))
    assert not out.exists()  # killed before finalize
    meta = {"round": 0, "arm": "A", "label": "A", "start_s": 0.0, "end_s": 1.0,
            "returncode": "timeout", "parquet": out, "stats": tmp_path / "none"}
    row, req = runner._round_rows(meta, runner._expected_keys(prompts))
    assert row["lost_requests"] == 2  # lines 2 and 3 were never served
    assert sorted(req.id) == ["a", "b"] and row["errors"] == 0  # the newest row per key
    assert row["failed"] is True and row["returncode"] == "timeout"


def test_arm_file_that_is_not_utf8_is_a_usage_error(tmp_path):
    """A UTF-16 arm file (an editor's choice) raised UnicodeDecodeError: a traceback, exit 1."""
    cfg = tmp_path / "A.yaml"
    cfg.write_bytes("kv: kv8\n".encode("utf-16"))
    with pytest.raises(UsageError, match=r"A\.yaml: not UTF-8 text \(byte 0\)"):
        load_arm(cfg)


def test_arm_file_with_a_key_given_twice_is_a_usage_error(tmp_path):
    """PyYAML keeps the last of two equal keys: an arm file with `slots: 2` then `slots: 8`
    (in its job part or in its soak section) ran with 8, unlike a job config given to
    generate, which refuses it."""
    for text, key, lines in (("kv: kv8\nslots: 2\nslots: 8\n", "slots", (3, 2)),
                             ("kv: kv8\nsoak:\n  label: new\n  label: old\n", "label", (4, 3))):
        cfg = tmp_path / "B.yaml"
        cfg.write_text(text)
        with pytest.raises(UsageError, match=rf"B\.yaml: line {lines[0]}: key '{key}' is given "
                                             rf"twice in one mapping \(first on line {lines[1]}\)"):
            load_arm(cfg, "B")


def test_prompts_that_cannot_be_read_are_a_usage_error(tmp_path):
    """--prompts DIR passed the command's exists() check and ended in IsADirectoryError (a
    traceback) after --out was created."""
    (tmp_path / "prompts").mkdir()
    out = tmp_path / "soak"
    plan = runner.SoakPlan(arms=[_arm(tmp_path)], prompts=tmp_path / "prompts", out=out, rounds=1)
    with pytest.raises(UsageError, match=r"--prompts .*prompts: Is a directory"):
        runner.run_soak(plan)
    assert not out.exists()


FAKE_GENERATE = """\
# A build whose `generate` serves every line of the soak's prompts, then dies with exit 3
# (as a crash after the results were merged, or a killed process, would).
import sys
import pyarrow as pa, pyarrow.parquet as pq
out = sys.argv[sys.argv.index("--out") + 1]
rows = [("a", 1, "length", None), (None, 2, "error", "line 2: malformed JSON"),
        (None, 3, "error", "line 3: duplicate id 'a'"), ("b", 4, "stop", None)]
pq.write_table(pa.Table.from_pylist([
    {"id": i, "line": n, "finish_reason": f, "error": e, "completion_tokens": [1, 2],
     "ttft_s": 0.1, "decode_tokens_per_s": 10.0} for i, n, f, e in rows]), out)
sys.exit(3)
"""


def _fake_checkout_arm(tmp_path, monkeypatch, generate: str, soak_yaml: str, counted=None):
    """An arm config whose soak.working_dir is a fake checkout: its `python -m cluster` is
    `generate` (a script that writes a results file). Ray is not started (_no_ray)."""
    _no_ray(monkeypatch, counted)
    build = tmp_path / "build"
    (build / "cluster").mkdir(parents=True)
    (build / "cluster" / "__main__.py").write_text(generate)
    cfg = tmp_path / "arm.yaml"
    cfg.write_text(f"kv: kv8\nsoak:\n{soak_yaml}  working_dir: build\n")
    return cfg


def _no_ray(monkeypatch, counted=None):
    """The soak without Ray: it only hands the rounds an address; its metrics Counter is a
    stand-in that appends (name, arm, value) to `counted` for each record or increment."""
    import ray
    import ray.util.metrics

    class FakeCounter:
        def __init__(self, name, *a, **kw):
            self.name = name

        def _record(self, value, tags):
            if counted is not None:
                counted.append((self.name, tags["arm"], value))

        inc = _record

    monkeypatch.setattr(ray.util.metrics, "Counter", FakeCounter)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context",
                        lambda: type("Ctx", (), {"gcs_address": "127.0.0.1:1"})())


def test_a_round_that_exits_nonzero_fails_the_soak(tmp_path, monkeypatch):
    """A round's run served every line and then exited 3: nothing lost, so the soak passed
    (exit 0) with a crashed build. Its rows stay, and the failed round fails the gate, shows in
    rounds.parquet, summary.json and the report. (A fake checkout runs the round; Ray is not
    started: the soak only hands the rounds its address.)"""
    counted = []
    cfg = _fake_checkout_arm(tmp_path, monkeypatch, FAKE_GENERATE, "  label: crashy\n", counted)
    out = tmp_path / "soak"
    plan = runner.SoakPlan(arms=[load_arm(cfg)], prompts=_prompts(tmp_path), out=out, rounds=2)
    summary, code = runner.run_soak(plan)
    assert code == 1
    assert summary["gate"]["failures"] == [
        "failed rounds (round 0 A: exit status 3, round 1 A: exit status 3) = 2 > 0"]
    assert summary["faults"]["lost_requests"] == 0 and summary["faults"]["failed_rounds"] == 2
    rounds = pd.read_parquet(out / "rounds.parquet")
    assert rounds.failed.tolist() == [True, True] and rounds.returncode.tolist() == ["3", "3"]
    assert len(pd.read_parquet(out / "requests.parquet")) == 8  # the served rows are kept
    written = json.loads((out / "summary.json").read_text())
    assert written["metrics"]["A"]["failed_rounds"] == 2
    # the fake checkout has no config code of its own: checked here, and the summary says so
    assert written["config_check"]["A"].startswith("this checkout ") and "could not" in \
        written["config_check"]["A"]
    page = (out / "report.html").read_text()
    assert "failed rounds: 2" in page and "exit status 3" in page and "rounds/r001_A.log" in page
    # the failed-rounds counter: A's series at 0 from the start, then one per failed round
    assert counted == [("kvfleet_soak_failed_rounds", "A", 0)] + [
        ("kvfleet_soak_failed_rounds", "A", 1)] * 2
    # its rows count in the accounting, but no completed round: no performance figure
    a = summary["metrics"]["A"]
    assert a["completed_rounds"] == 0 and a["throughput_tok_s"]["n"] == 0
    assert a["request_ttft_s"]["n"] == 0 and a["errors"]["max"] == 2


def test_rounds_rows_carry_the_temperature_each_line_ran_at(tmp_path):
    """Parity needs each line's temperature: its own where the line sets one (0 included),
    else the arm's job temperature; input-error lines get the arm's."""
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join([json.dumps({"id": "g", "prompt": "x"}),
                            json.dumps({"id": "s", "prompt": "x", "temperature": 0.8}),
                            json.dumps({"id": "z", "prompt": "x", "temperature": 0}),
                            json.dumps({"id": "bad", "prompt": "x", "temperature": -1})]) + "\n")
    keys, own = runner._read_prompts(p)
    assert keys == {"g", "s", "z", "bad"} and own == {2: 0.8, 3: 0.0}
    req = pd.DataFrame({"id": ["g", "s", "z", "bad"], "line": [1, 2, 3, 4]})
    assert runner.with_temperatures(req, own, 0.0).temperature.tolist() == [0.0, 0.8, 0.0, 0.0]
    assert runner.with_temperatures(req, own, 0.6).temperature.tolist() == [0.6, 0.8, 0.0, 0.6]
    cfg = tmp_path / "hot.yaml"
    cfg.write_text("sampling: {temperature: 0.6}\n")
    assert load_arm(cfg).temperature == 0.6


INVALID_ONLY_GENERATE = """\
# generate on prompts whose every line is invalid: one input-error row a line, exit 0
import sys
import pyarrow as pa, pyarrow.parquet as pq
out = sys.argv[sys.argv.index("--out") + 1]
pq.write_table(pa.Table.from_pylist([
    {"id": None, "line": n, "finish_reason": "error", "error": f"line {n}: malformed JSON",
     "completion_tokens": [], "ttft_s": None, "decode_tokens_per_s": None} for n in (1, 2)]), out)
"""


def test_a_soak_of_only_invalid_prompt_lines_fails_the_default_gate(tmp_path, monkeypatch):
    """Every prompt line malformed: each round's rows are input errors, which count as
    served, every run exits 0, and max_errors is null by default: the single-arm soak
    passed (exit 0) having served nothing."""
    cfg = _fake_checkout_arm(tmp_path, monkeypatch, INVALID_ONLY_GENERATE, "")
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"id": "a", "prompt": \n{"prompt": 3}\n')
    plan = runner.SoakPlan(arms=[load_arm(cfg)], prompts=prompts, out=tmp_path / "soak", rounds=2)
    summary, code = runner.run_soak(plan)
    assert summary["faults"]["lost_requests"] == 0 and summary["faults"]["failed_rounds"] == 0
    assert code == 1 and summary["gate"]["failures"] == [
        "successful requests (A: no request of any round finished with stop or length) = 0 < 1"]
    assert summary["metrics"]["A"]["ok_requests"] == 0



RUNTIME_ERROR_GENERATE = """\
# An older build's `generate`: in round 1 one row failed at run time (its worker's step
# raised) and it still exits 0; every round writes --stats with the scheduler's counters.
import json, sys
import pyarrow as pa, pyarrow.parquet as pq
out = sys.argv[sys.argv.index("--out") + 1]
second = "r001_" in out
rows = [("a", 1, "length", None), (None, 2, "error", "line 2: malformed JSON"),
        (None, 3, "error", "line 3: duplicate id 'a'"),
        ("b", 4, "error", "worker step failed: RuntimeError('CUDA error')") if second
        else ("b", 4, "stop", None)]
pq.write_table(pa.Table.from_pylist([
    {"id": i, "line": n, "finish_reason": f, "error": e, "completion_tokens": [1, 2],
     "ttft_s": 0.1, "decode_tokens_per_s": 10.0} for i, n, f, e in rows]), out)
stats = sys.argv[sys.argv.index("--stats") + 1]
with open(stats, "w") as f:
    json.dump({"tokens": 4, "wall_s": 1.0, "worker_deaths": int(second), "recoveries": 0,
               "requeued": 3 * second, "fallbacks": {"cpu.polar_rebuild_rows": 5},
               "kv_cache": {"hits": 1, "saved_tokens": 10 + second}, "workers": []}, f)
"""


def test_a_round_with_rows_failed_at_run_time_is_a_failed_round(tmp_path, monkeypatch):
    """Round 1's run (an older build, which exits 0 on them) left a row that failed at run
    time: the round counted as completed (its figures in the medians), only its lost row
    failed the gate. It is a failed round now, named with its count in the gate, the summary
    and the report."""
    cfg = _fake_checkout_arm(tmp_path, monkeypatch, RUNTIME_ERROR_GENERATE, "  label: old\n")
    out = tmp_path / "soak"
    plan = runner.SoakPlan(arms=[load_arm(cfg)], prompts=_prompts(tmp_path), out=out, rounds=2)
    summary, code = runner.run_soak(plan)
    assert code == 1 and summary["gate"]["failures"] == [
        "lost requests = 1 > 0",  # (a row failed at run time was not served: as before)
        "failed rounds (round 1 A: exit status 0, 1 rows failed at run time) = 1 > 0"]
    assert summary["failed_rounds"] == [
        {"round": 1, "arm": "A", "returncode": "0", "runtime_errors": 1}]
    rounds = pd.read_parquet(out / "rounds.parquet")
    assert rounds.failed.tolist() == [False, True] and rounds.returncode.tolist() == ["0", "0"]
    assert rounds.runtime_errors.tolist() == [0, 1] and rounds.errors.tolist() == [2, 3]
    a = json.loads((out / "summary.json").read_text())["metrics"]["A"]
    assert a["completed_rounds"] == 1 and a["throughput_tok_s"]["n"] == 1  # round 0 only
    page = (out / "report.html").read_text()
    assert "<td>1</td><td>A</td><td>exit status 0, 1 rows failed at run time</td>" in page


def test_the_rounds_scheduler_counters_are_summed_per_arm(tmp_path, monkeypatch):
    """The scheduler counters of the runs' --stats (worker deaths, re-queued sequences,
    fallbacks per path, saved-KV events) were dropped (only recoveries was kept): each round
    keeps them in rounds.parquet, and they are summed per arm over every round, failed ones
    included, in summary.json and the report."""
    cfg = _fake_checkout_arm(tmp_path, monkeypatch, RUNTIME_ERROR_GENERATE, "  label: old\n")
    out = tmp_path / "soak"
    plan = runner.SoakPlan(arms=[load_arm(cfg)], prompts=_prompts(tmp_path), out=out, rounds=2)
    runner.run_soak(plan)
    rounds = pd.read_parquet(out / "rounds.parquet")
    assert rounds.worker_deaths.tolist() == [0, 1] and rounds.requeued.tolist() == [0, 3]
    assert rounds["fallbacks.cpu.polar_rebuild_rows"].tolist() == [5, 5]
    assert rounds["kv_cache.saved_tokens"].tolist() == [10, 11]
    a = json.loads((out / "summary.json").read_text())["metrics"]["A"]
    assert a["counters"] == {"worker_deaths": 1, "recoveries": 0, "requeued": 3,
                             "runtime_errors": 1, "fallbacks": {"cpu.polar_rebuild_rows": 10},
                             "kv_cache": {"hits": 2, "saved_tokens": 21}}
    page = (out / "report.html").read_text()
    assert "<h2>scheduler counters</h2>" in page and "<th>A (old)</th>" in page
    for name, n in (("worker deaths", 1), ("rows failed at run time", 1),
                    ("sequences re-queued", 3), ("fallback: cpu.polar_rebuild_rows", 10),
                    ("KV cache: hits", 2), ("KV cache: saved_tokens", 21)):
        assert f"<tr><th>{name}</th><td>{n}</td></tr>" in page, name


SERVE_EVERY_LINE = """\
def serve(out):  # the rows of a run on _prompts(): lines 1 and 4 served, 2 and 3 input errors
    import pyarrow as pa, pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist([
        {"id": i, "line": n, "finish_reason": "length", "error": None, "completion_tokens": [1],
         "ttft_s": 0.1, "decode_tokens_per_s": 10.0} for i, n in (("a", 1), ("b", 4))]
        + [{"id": None, "line": n, "finish_reason": "error", "error": f"line {n}: bad",
            "completion_tokens": [], "ttft_s": None, "decode_tokens_per_s": None}
           for n in (2, 3)]), out)
"""


class _MarkerInjector:
    """A stand-in for WorkerKiller: records a kill (as it does) each time a fake run leaves
    a `<out>.stepping` or `<out>.done` marker, then answers with `<marker>.killed`."""

    def __init__(self, out):
        import threading
        self.out, self.round, self.events = out, (-1, ""), []
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __call__(self, every_s):
        return self

    def start(self):
        self.thread.start()

    def _run(self):
        while not self.halt.wait(0.01):
            for marker in sorted((self.out / "rounds").glob("*.parquet.*")):
                killed = marker.with_name(marker.name + ".killed")
                if marker.suffix in (".stepping", ".done") and not killed.exists():
                    rnd, arm = self.round
                    self.events.append({"time_s": runner.time.time(), "round": rnd, "arm": arm,
                                        "worker": f"w{rnd}", "pid": 100 + rnd})
                    killed.touch()

    def stop(self):
        self.halt.set()
        self.thread.join(timeout=5)


LATE_KILL_GENERATE = SERVE_EVERY_LINE + """\
# generate whose injector (the test's) kills one worker while it steps, then one after its
# last step: it serves every line, finds the first death (recovered) and writes --stats
import json, os, sys, time
out = sys.argv[sys.argv.index("--out") + 1]
def handshake(name):  # a marker for the injector, then wait until it has killed
    open(out + name, "w").close()
    while not os.path.exists(out + name + ".killed"):
        time.sleep(0.01)
handshake(".stepping")
steps_done_at = time.time()
handshake(".done")
serve(out)
with open(sys.argv[sys.argv.index("--stats") + 1], "w") as f:
    json.dump({"tokens": 2, "wall_s": 1.0, "worker_deaths": 1, "recoveries": 1,
               "steps_done_at": steps_done_at, "workers": []}, f)
"""


def test_a_kill_after_the_rounds_last_step_is_no_kill_of_the_round(tmp_path, monkeypatch):
    """A worker killed after its round's job had taken its last step had nothing left to
    run: no death is found, nothing recovers. It counted as a kill of that round, so the
    round read '2 kills, 1 recovery' (a kill with no recovery). It is counted apart now, as
    after the end, in rounds.parquet, faults.parquet, the summary and the report."""
    cfg = _fake_checkout_arm(tmp_path, monkeypatch, LATE_KILL_GENERATE, "")
    out = tmp_path / "soak"
    monkeypatch.setattr(runner, "WorkerKiller", _MarkerInjector(out))
    plan = runner.SoakPlan(arms=[load_arm(cfg)], prompts=_prompts(tmp_path), out=out, rounds=2,
                           kill_every_s=1.0)
    summary, code = runner.run_soak(plan)
    assert code == 0, summary["gate"]
    assert summary["faults"] == {"kills": 2, "kills_unseen": 0, "kills_unknown": 0,
                                 "kills_after_end": 2, "recoveries": 2, "lost_requests": 0,
                                 "failed_rounds": 0}
    rounds = pd.read_parquet(out / "rounds.parquet")
    assert rounds.kills.tolist() == [1, 1] and rounds.kills_after_end.tolist() == [1, 1]
    assert rounds.kills.tolist() == rounds.recoveries.tolist()
    faults = pd.read_parquet(out / "faults.parquet")
    assert faults["round"].tolist() == [0, 0, 1, 1]
    assert faults.after_end.tolist() == [False, True, False, True]
    assert faults.outcome.tolist() == ["found", "after_end"] * 2
    page = (out / "report.html").read_text()
    assert "2 worker kills while a round's job ran (2 found dead by the job), 2 recoveries, " \
           "0 lost requests; 2 more killed after their round's job had taken its last step" in page
    # a run with no steps_done_at (an older build, a crash): the run's end is the bound
    rounds = rounds.assign(steps_done_at=None)
    late = runner.classify_kills([{"time_s": rounds.end_s[0] - 1e-3, "round": 0, "arm": "A"},
                                  {"time_s": rounds.end_s[0] + 1e-3, "round": 0, "arm": "A"},
                                  {"time_s": rounds.start_s[1] - 1e-3, "round": 1, "arm": "A"},
                                  {"time_s": rounds.start_s[0], "round": -1, "arm": ""}], rounds)
    assert [k["after_end"] for k in late] == [False, True, True, True]


IDLE_KILL_GENERATE = SERVE_EVERY_LINE + """\
# generate whose injector (the test's) kills a worker while the job steps, but on a worker
# with nothing in flight: round 0's scheduler finds no death (worker_deaths 0); round 1
# crashes (exit 1) before writing --stats, so nothing says what it found
import json, os, sys, time
out = sys.argv[sys.argv.index("--out") + 1]
open(out + ".stepping", "w").close()
while not os.path.exists(out + ".stepping.killed"):
    time.sleep(0.01)
serve(out)
if "r001_" in out:
    sys.exit(1)
with open(sys.argv[sys.argv.index("--stats") + 1], "w") as f:
    json.dump({"tokens": 2, "wall_s": 1.0, "worker_deaths": 0, "recoveries": 0,
               "steps_done_at": time.time(), "workers": []}, f)
"""


def test_a_kill_the_job_never_found_is_classified_not_read_as_unrecovered(
        tmp_path, monkeypatch, capsys):
    """A worker killed while it had nothing in flight is never stepped again: the job finds
    no death and nothing recovers. It counted as a plain kill (kills 1, recoveries 0, as a
    kill the job failed to recover from) and the warning for a soak that tested no recovery
    stayed silent. Now every kill has an outcome in faults.parquet: unseen (no death found),
    unknown (its run crashed before recording its deaths), counted per round and in the
    summary, said in the report; and the command warns that no kill was found dead."""
    from cluster.cli import main
    cfg = _fake_checkout_arm(tmp_path, monkeypatch, IDLE_KILL_GENERATE, "")
    out = tmp_path / "soak"
    monkeypatch.setattr(runner, "WorkerKiller", _MarkerInjector(out))
    code = main(["soak", "--config", str(cfg), "--prompts", str(_prompts(tmp_path)),
                 "--rounds", "2", "--out", str(out), "--kill-worker-every", "1s"])
    assert code == 1  # (round 1 failed: it exited 1)
    s = json.loads((out / "summary.json").read_text())
    assert s["faults"] == {"kills": 2, "kills_unseen": 1, "kills_unknown": 1,
                           "kills_after_end": 0, "recoveries": 0, "lost_requests": 0,
                           "failed_rounds": 1}
    faults = pd.read_parquet(out / "faults.parquet")
    assert faults.outcome.tolist() == ["unseen", "unknown"]
    assert faults.after_end.tolist() == [False, False] and faults.pid.tolist() == [100, 101]
    rounds = pd.read_parquet(out / "rounds.parquet")
    assert rounds.kills.tolist() == [1, 1] and rounds.kills_unseen.tolist() == [1, 0]
    assert rounds.kills_unknown.tolist() == [0, 1]
    assert rounds.worker_deaths[0] == 0 and pd.isna(rounds.worker_deaths[1])  # not recorded
    page = (out / "report.html").read_text()
    assert "2 worker kills while a round's job ran (0 found dead by the job; 1 of an idle " \
           "worker" in page
    assert "1 in rounds whose run recorded no count of the deaths it found" in page
    err = capsys.readouterr().err
    assert "killed no worker that a round's job found dead: of its kills, 1 killed an idle " \
           "worker that the job never stepped again, 1 landed in rounds whose run recorded " \
           "no deaths count, which tests no recovery" in err


def test_kills_are_found_in_time_order_up_to_the_rounds_deaths():
    """The job counts its deaths, not which worker each was: a round's first kills are the
    found ones, the rest unseen; a kill before the first round or past the steps is late."""
    rounds = pd.DataFrame({"round": [0, 1], "arm": ["A", "A"], "start_s": [10.0, 20.0],
                           "end_s": [19.0, 29.0], "steps_done_at": [18.0, None],
                           "worker_deaths": [1, 3]})
    kills = [{"time_s": t, "round": r, "arm": "A"} for t, r in
             ((15.0, 0), (11.0, 0), (18.5, 0), (5.0, -1), (21.0, 1), (28.9, 1))]
    got = [(k["time_s"], k["outcome"]) for k in runner.classify_kills(kills, rounds)]
    assert got == [(15.0, "unseen"), (11.0, "found"), (18.5, "after_end"), (5.0, "after_end"),
                   (21.0, "found"), (28.9, "found")]  # (in the order given)


def _other_build(tmp_path, *edits):
    """A second checkout of this code (a copy of the tree) whose cluster/config.py has
    `edits` applied: (old, new) text replacements, each of which must apply."""
    import shutil
    from cluster.config import REPO_ROOT
    build = tmp_path / "newer"
    for pkg in ("cluster", "kernels", "workers", "kvstore"):
        shutil.copytree(REPO_ROOT / pkg, build / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    conf = build / "cluster" / "config.py"
    text = conf.read_text()
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    conf.write_text(text)
    return build


def test_an_arms_job_config_is_validated_by_its_own_checkout(tmp_path, caplog):
    """Arm B's job config was validated with THIS checkout's schema: a setting that only
    B's newer build knows was refused (B could not be soaked), and one that B's build
    refuses was accepted (every round then failed on it). B's own code checks it now, and
    B's job temperature, which parity decides greedy lines by, is its build's default."""
    build = _other_build(
        tmp_path,
        ("    slots: int = Field(8, ge=1)\n",
         "    slots: int = Field(8, ge=1, le=4)\n    spec_decode_draft: int = Field(0, ge=0)\n"),
        ("    temperature: float = Field(0.0,", "    temperature: float = Field(0.7,"))
    new = tmp_path / "B.yaml"
    new.write_text("kv: kv8\nspec_decode_draft: 2\nsoak:\n  working_dir: newer\n")
    arm = load_arm(new, "B")
    assert arm.working_dir == build.resolve() and arm.temperature == 0.7
    assert arm.checked_by == f"its own checkout {build.resolve()}"
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    too_many = tmp_path / "B2.yaml"  # fine here (slots >= 1), refused by the build that runs it
    too_many.write_text("slots: 6\nsoak:\n  working_dir: newer\n")
    with pytest.raises(UsageError, match=r"^--vs: the job config is refused by soak\.working_dir "
                       r".*newer's own code: .*B2\.yaml: slots: Input should be less than or "
                       r"equal to 4 \(got 6\)$"):
        load_arm(too_many, "B")
    here = tmp_path / "here.yaml"  # the same setting for this checkout's code: refused
    here.write_text("spec_decode_draft: 2\n")
    with pytest.raises(UsageError, match=r"here\.yaml: spec_decode_draft: Extra inputs"):
        load_arm(here, "B")


def test_an_arm_whose_checkout_cannot_check_its_config_falls_back_visibly(tmp_path, caplog):
    from cluster.config import REPO_ROOT
    """A checkout whose `cluster` is no package (no __init__.py: python imports another
    install's, e.g. an editable one's) cannot say, nor one whose code does not import: the
    soak warns, naming the arm and why, and checks the config with this checkout's schema."""
    build = tmp_path / "broken"
    (build / "cluster").mkdir(parents=True)
    (build / "cluster" / "__main__.py").write_text("")
    cfg = tmp_path / "B.yaml"
    cfg.write_text("kv: kv8\nsoak:\n  working_dir: broken\n")
    arm = load_arm(cfg, "B")
    assert arm.checked_by.startswith("this checkout ") and "not that checkout's" in arm.checked_by
    (build / "cluster" / "__init__.py").write_text("")
    (build / "cluster" / "config.py").write_text("raise ImportError('needs pydantic 9')\n")
    caplog.clear()
    arm = load_arm(cfg, "B")
    assert arm.checked_by == (f"this checkout {REPO_ROOT} (its own checkout {build} could not: "
                              "ImportError: needs pydantic 9)")
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 2 and warned[0].startswith(f"--vs {cfg}: cannot validate its job "
                                                     f"config with soak.working_dir {build}")
    # nor which variables its code reads job settings from: this checkout's are withheld
    assert warned[1].startswith(f"--vs {cfg}: soak.working_dir {build}'s code cannot say which "
                                "environment variables it reads job settings from (ImportError: "
                                "needs pydantic 9); withholding this checkout's")
    assert arm.job_env == JOB_ENV and arm.job_env_from == arm.checked_by
    cfg.write_text("kv: kv9\nsoak:\n  working_dir: broken\n")  # this checkout still refuses
    with pytest.raises(UsageError, match=r"B\.yaml: kv: .*kv9"):
        load_arm(cfg, "B")
    cfg.write_text("soak:\n  working_dir: ~/no-such-kvfleet-checkout\n")
    with pytest.raises(UsageError, match=r"soak\.working_dir /.*/no-such-kvfleet-checkout is "
                       r"not a kvfleet checkout \(no such directory\)"):
        load_arm(cfg, "B")


ENV_RECORDING_GENERATE = SERVE_EVERY_LINE + """\
# generate that records the environment it ran in (OUT.env.json), then serves every line
import json, os, sys
out = sys.argv[sys.argv.index("--out") + 1]
with open(out + ".env.json", "w") as f:
    json.dump(dict(os.environ), f)
serve(out)
"""


def _round_env(out, stem):
    return json.loads((out / "rounds" / f"{stem}.parquet.env.json").read_text())


def test_a_job_variable_only_the_arms_checkout_reads_is_withheld_from_it(
        tmp_path, monkeypatch, caplog):
    """The variables withheld from the rounds were this checkout's alone: a newer build that
    sets a job field from one that this checkout does not know got it from the operator's
    shell, in its config check (which refused a value there, or took one, that its config
    does not say) and in its every round, while the other arm's build had no such setting:
    an A/B of unequal configs. The arm's own checkout now declares its list, withheld from
    its check and its rounds, and the warning names what each arm does not get."""
    build = _other_build(
        tmp_path,
        ("    slots: int = Field(8, ge=1)\n",
         "    slots: int = Field(8, ge=1)\n    spec_decode_draft: int = Field(0, ge=0, le=4)\n"),
        ('    "KVFLEET_KV_CACHE_FORMAT": ("kv_cache_format", str),\n',
         '    "KVFLEET_KV_CACHE_FORMAT": ("kv_cache_format", str),\n'
         '    "KVFLEET_SPEC_DRAFT": ("spec_decode_draft", int),\n'))
    (build / "cluster" / "__main__.py").write_text(ENV_RECORDING_GENERATE)
    a = _fake_checkout_arm(tmp_path, monkeypatch, ENV_RECORDING_GENERATE, "  label: old\n")
    b = tmp_path / "B.yaml"
    b.write_text("kv: kv8\nspec_decode_draft: 1\nsoak:\n  working_dir: newer\n")
    monkeypatch.setenv("KVFLEET_SPEC_DRAFT", "3")
    monkeypatch.setenv("KV8", "1")
    monkeypatch.setenv("KVFLEET_KEEP_ME", "yes")
    out = tmp_path / "soak"
    plan = runner.SoakPlan(arms=[load_arm(a, "A"), load_arm(b, "B")], prompts=_prompts(tmp_path),
                           out=out, rounds=1)
    caplog.clear()
    summary, _ = runner.run_soak(plan)  # (the fake rounds write no stats: no throughput ratio)
    assert summary["failed_rounds"] == []
    env_b = _round_env(out, "r000_B")
    assert "KVFLEET_SPEC_DRAFT" not in env_b and "KV8" not in env_b
    assert env_b["KVFLEET_KEEP_ME"] == "yes"
    # arm A's build (no code of its own to say) withholds this checkout's list
    env_a = _round_env(out, "r000_A")
    assert "KV8" not in env_a and env_a["KVFLEET_SPEC_DRAFT"] == "3"
    warned = sorted(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert warned == [
        "soak: KV8 set in the environment, not passed to the rounds of arm A (each arm runs its "
        "own config)",
        "soak: KV8, KVFLEET_SPEC_DRAFT set in the environment, not passed to the rounds of arm B "
        "(each arm runs its own config)"]
    got = json.loads((out / "summary.json").read_text())["job_env"]
    assert got["B"]["from"] == f"its own checkout {build}"
    assert set(got["B"]["variables"]) == JOB_ENV | {"KVFLEET_SPEC_DRAFT"}
    assert got["B"]["withheld"] == ["KV8", "KVFLEET_SPEC_DRAFT"]
    assert got["A"]["from"].startswith("this checkout ") and "could not" in got["A"]["from"]
    assert got["A"]["variables"] == sorted(JOB_ENV) and got["A"]["withheld"] == ["KV8"]
    # its config check runs as its rounds do: a value its config does not say is no refusal
    monkeypatch.setenv("KVFLEET_SPEC_DRAFT", "9")
    arm = load_arm(b, "B")
    assert arm.checked_by == f"its own checkout {build}" and "KVFLEET_SPEC_DRAFT" in arm.job_env


def test_an_arm_whose_checkout_declares_no_job_variables_falls_back_visibly(
        tmp_path, monkeypatch, caplog):
    """An older build whose config code checks the job config but declares no list of the
    variables it reads (neither JOB_ENV nor ENV_FIELDS): the soak warns, withholds this
    checkout's list, and summary.json says so, while the config check is still its own."""
    cfg = _fake_checkout_arm(tmp_path, monkeypatch, ENV_RECORDING_GENERATE, "")
    build = tmp_path / "build"
    (build / "cluster" / "__init__.py").write_text("")
    (build / "cluster" / "cli.py").write_text("class UsageError(Exception):\n    pass\n")
    (build / "cluster" / "config.py").write_text(
        "import os, types\n"
        "def load_job_config(path):  # reads OLD_KNOB, declared nowhere\n"
        "    t = float(os.environ.get('OLD_KNOB', '0.25'))\n"
        "    return types.SimpleNamespace(sampling=types.SimpleNamespace(temperature=t))\n")
    monkeypatch.setenv("OLD_KNOB", "0.5")
    monkeypatch.setenv("KVFLEET_SLOTS", "3")
    arm = load_arm(cfg, "A")
    assert arm.checked_by == f"its own checkout {build}" and arm.temperature == 0.5
    reason = "its cluster/config.py declares neither JOB_ENV nor ENV_FIELDS"
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == [
        f"--config {cfg}: soak.working_dir {build}'s code cannot say which environment "
        f"variables it reads job settings from ({reason}); withholding this checkout's "
        f"({runner.REPO_ROOT}) from that arm's rounds instead: one that only that build reads, "
        "if set, still reaches them"]
    assert arm.job_env == JOB_ENV
    out = tmp_path / "soak"
    summary, code = runner.run_soak(runner.SoakPlan(arms=[arm], prompts=_prompts(tmp_path),
                                                    out=out, rounds=1))
    assert code == 0, summary["gate"]
    env = _round_env(out, "r000_A")
    assert "KVFLEET_SLOTS" not in env and env["OLD_KNOB"] == "0.5"  # (what the warning said)
    got = json.loads((out / "summary.json").read_text())["job_env"]["A"]
    assert got == {"from": f"this checkout {runner.REPO_ROOT} (its own checkout {build} could "
                           f"not: {reason})", "variables": sorted(JOB_ENV),
                   "withheld": ["KVFLEET_SLOTS"]}


CONFIG_READING_GENERATE = SERVE_EVERY_LINE + """\
# generate that reads its --config as the real one does (relative to its cwd: the arm's
# checkout) and exits 2 where it cannot, else serves every line
import sys
from pathlib import Path
if not Path(sys.argv[sys.argv.index("--config") + 1]).is_file():
    sys.exit(2)
serve(sys.argv[sys.argv.index("--out") + 1])
"""


def test_a_relative_out_works_for_an_arm_in_another_checkout(tmp_path, monkeypatch):
    """`--out soak` (relative to the operator's cwd) handed the round its job config as
    soak/rounds/A.job.yaml, which the round, running in the arm's checkout, read relative to
    that checkout: no such file, exit 2, every round failed."""
    cfg = _fake_checkout_arm(tmp_path, monkeypatch, CONFIG_READING_GENERATE, "")
    monkeypatch.chdir(tmp_path)
    plan = runner.SoakPlan(arms=[load_arm(cfg)], prompts=_prompts(tmp_path),
                           out=runner.Path("soak"), rounds=1)
    summary, code = runner.run_soak(plan)
    assert summary["failed_rounds"] == [] and code == 0, summary["gate"]
    assert (tmp_path / "soak" / "rounds" / "A.job.yaml").is_file()


def test_the_round_timeout_is_a_flag(tmp_path, monkeypatch, capsys):
    """A round's limit was fixed at 30 minutes: a build whose rounds rightly take longer
    timed out every round, one that hangs held the soak 30 minutes a round. --round-timeout
    sets it (a bad value names the flag)."""
    from cluster.cli import main
    cfg = _fake_checkout_arm(tmp_path, monkeypatch, "import time\ntime.sleep(60)\n", "")
    args = ["soak", "--config", str(cfg), "--prompts", str(_prompts(tmp_path)), "--rounds", "1"]
    assert main(args + ["--out", str(tmp_path / "bad"), "--round-timeout", "0"]) == 2
    assert "--round-timeout '0': give a positive duration" in capsys.readouterr().err
    t0 = runner.time.monotonic()
    assert main(args + ["--out", str(tmp_path / "soak"), "--round-timeout", "1.5s"]) == 1
    assert runner.time.monotonic() - t0 < 30
    s = json.loads((tmp_path / "soak" / "summary.json").read_text())
    assert s["failed_rounds"] == [{"round": 0, "arm": "A", "returncode": "timeout",
                                   "runtime_errors": 0}]
    assert s["faults"]["lost_requests"] == 4


def test_a_slower_b_past_the_duration_is_measured_not_timed_out(tmp_path, monkeypatch):
    """B's round was limited to twice A's longest round once the duration was spent: a
    build 3x slower than its baseline (a regression to measure) was killed as a timeout, its
    requests counted lost and no ratio measured. Each arm's limit follows its own rounds."""
    def build(name: str, sleep_s: float):
        d = tmp_path / name
        (d / "cluster").mkdir(parents=True)
        (d / "cluster" / "__main__.py").write_text(
            f"import time\ntime.sleep({sleep_s})\n" + FAKE_GENERATE.replace("sys.exit(3)", ""))
        (d / f"{name}.yaml").write_text(f"kv: kv8\nsoak:\n  working_dir: .\n  label: {name}\n")
        return load_arm(d / f"{name}.yaml", "A" if name == "fast" else "B")

    _no_ray(monkeypatch)
    plan = runner.SoakPlan(arms=[build("fast", 0.0), build("slow", 6.0)],
                           prompts=_prompts(tmp_path), out=tmp_path / "soak", duration_s=0.1,
                           round_timeout_s=120.0)
    summary, _ = runner.run_soak(plan)
    rounds = pd.read_parquet(tmp_path / "soak" / "rounds.parquet")
    a, b = rounds.wall_s.tolist()
    assert b > 2 * a  # (what the old limit, 2x A's round, cut)
    assert summary["failed_rounds"] == [] and summary["faults"]["lost_requests"] == 0
    assert summary["ratio_B_over_A"]["wall_s"]["n"] == 1


def _git(wd, *args):
    return subprocess.run(["git", "-C", str(wd), "-c", "user.name=t", "-c", "user.email=t@t",
                           *args], check=True, capture_output=True, text=True).stdout


def test_build_info_records_the_commit_the_dirt_and_why_not(tmp_path, monkeypatch):
    """summary.json did not say which build an arm ran: now its checkout's commit, whether
    its tree was dirty (and how much), its version; where git cannot say, null and why."""
    from cluster.soak.build import build_info
    repo = tmp_path / "repo"
    (repo / "cluster").mkdir(parents=True)
    (repo / "cluster" / "x.py").write_text("a = 1\n")
    (repo / "pyproject.toml").write_text("[project]\nversion = \"0.2.0rc1\"\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "x")
    head = _git(repo, "rev-parse", "HEAD").strip()
    assert build_info(repo) == {"checkout": str(repo), "commit": head, "dirty": False,
                                "changed_files": 0, "git_error": None, "version": "0.2.0rc1",
                                "version_error": None}
    (repo / "cluster" / "x.py").write_text("a = 2\n")  # modified, and two untracked files
    (repo / "new file.py").write_text("")
    (repo / "pyproject.toml").write_text("[project\n")
    (repo / "other.py").write_text("")
    got = build_info(repo)
    assert (got["commit"], got["dirty"], got["changed_files"]) == (head, True, 4)
    assert got["version"] is None and got["version_error"].startswith("pyproject.toml: ")
    plain = tmp_path / "plain"
    plain.mkdir()
    got = build_info(plain)
    assert got["commit"] is got["dirty"] is got["changed_files"] is None
    assert "not a git repository" in got["git_error"] and got["version_error"] == "no pyproject.toml"
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))  # (no git binary on it)
    got = build_info(repo)
    assert got["commit"] is None and got["git_error"] == "no git binary on PATH"
    assert build_info(tmp_path / "gone")["commit"] is None  # (a checkout gone since: no crash)


def test_the_console_names_each_arms_build_and_what_was_withheld(tmp_path, monkeypatch, capsys):
    """arm_lines was printed by nothing: the console said only 'gate passed'. Now one line
    per arm after the gate line, with its git revision (none: a checkout that is no git
    repository); a gate in B's file, which is ignored, is warned about once."""
    from cluster.cli import main
    cfg = _fake_checkout_arm(tmp_path, monkeypatch, SERVE_EVERY_LINE + (
        "import sys\nserve(sys.argv[sys.argv.index('--out') + 1])\n"),
        "  label: a\n  gate: {min_throughput_ratio: null}\n")
    b = tmp_path / "b.yaml"
    b.write_text("kv: kv8\nsoak:\n  label: b\n  working_dir: build\n  gate:\n"
                 "    max_lost_requests: 3\n")
    monkeypatch.setenv("KV8", "1")
    code = main(["soak", "--config", str(cfg), "--vs", str(b), "--prompts",
                 str(_prompts(tmp_path)), "--rounds", "1", "--out", str(tmp_path / "soak")])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    lines = out.splitlines()
    gate = next(i for i, line in enumerate(lines) if "gate passed" in line)
    s = json.loads((tmp_path / "soak" / "summary.json").read_text())
    why = s["build"]["A"]["git_error"]
    assert "not a git repository" in why and s["build"]["B"] == s["build"]["A"]
    build = tmp_path / "build"
    for i, (arm, label) in enumerate((("A", "a"), ("B", "b"))):
        assert lines[gate + 1 + i].startswith(
            f"soak: warning: arm {arm} ({label}): build {build}: no git commit ({why}); job "
            "config passed, but checked by this checkout "), lines
        assert lines[gate + 1 + i].endswith("withheld from its rounds: KV8 (1 of its "
                                            f"{len(JOB_ENV)} job variables, set here)")


def test_a_gate_in_the_b_file_is_warned_about_once(tmp_path, monkeypatch, caplog):
    cfg = _fake_checkout_arm(tmp_path, monkeypatch, SERVE_EVERY_LINE + (
        "import sys\nserve(sys.argv[sys.argv.index('--out') + 1])\n"), "")
    b = tmp_path / "b.yaml"
    b.write_text("kv: kv8\nsoak:\n  working_dir: build\n  gate: {}\n")
    plan = runner.SoakPlan(arms=[load_arm(cfg, "A"), load_arm(b, "B")],
                           prompts=_prompts(tmp_path), out=tmp_path / "soak", rounds=1)
    caplog.clear()
    runner.run_soak(plan)
    warned = [r.getMessage() for r in caplog.records if "soak.gate" in r.getMessage()]
    assert warned == [f"soak: --vs {b}: its soak.gate is ignored: the gate is arm A's "
                      f"(--config {cfg})"]
    b.write_text("kv: kv8\nsoak:\n  working_dir: build\n")  # (no gate of its own: no warning)
    caplog.clear()
    runner.run_soak(runner.SoakPlan(arms=[load_arm(cfg, "A"), load_arm(b, "B")],
                                    prompts=_prompts(tmp_path), out=tmp_path / "s2", rounds=1))
    assert not [r for r in caplog.records if "soak.gate" in r.getMessage()]


TRUNCATED_STATS_GENERATE = SERVE_EVERY_LINE + """\
# generate that serves every line, then leaves a --stats cut short in round 0 (a run killed
# while it wrote them, by an older build's non-atomic write) and whole ones after
import json, sys
out = sys.argv[sys.argv.index("--out") + 1]
stats = sys.argv[sys.argv.index("--stats") + 1]
serve(out)
doc = json.dumps({"tokens": 8, "wall_s": 2.0, "worker_deaths": 0})
open(stats, "w").write(doc[:17] if "r000_" in stats else doc)
"""


def test_a_round_whose_stats_are_truncated_fails_that_round_not_the_soak(tmp_path, monkeypatch):
    """json.loads of round 0's cut --stats raised out of the soak: every round lost, no
    summary. That round fails now (counted, its reason in the summary and the report),
    and the soak goes on."""
    cfg = _fake_checkout_arm(tmp_path, monkeypatch, TRUNCATED_STATS_GENERATE, "")
    out = tmp_path / "soak"
    summary, code = runner.run_soak(runner.SoakPlan(arms=[load_arm(cfg)],
                                                    prompts=_prompts(tmp_path), out=out, rounds=2))
    assert code == 1
    [bad] = summary["failed_rounds"]
    assert (bad["round"], bad["returncode"]) == (0, "0")
    assert bad["stats_error"].startswith("r000_A.stats.json: ")
    assert summary["gate"]["failures"] == [
        f"failed rounds (round 0 A: exit status 0, its --stats unreadable "
        f"({bad['stats_error']})) = 1 > 0"]
    rounds = pd.read_parquet(out / "rounds.parquet")
    assert rounds.failed.tolist() == [True, False]
    assert rounds.throughput_tok_s.tolist()[1] == 4.0  # (round 1's stats were read)
    assert "its --stats unreadable" in (out / "report.html").read_text()


SIGNAL_GENERATE = SERVE_EVERY_LINE + """\
# generate that serves round 0; in round ROUND it takes its --out's lock file (as the results
# store does), signals the soak (its parent) with SIG, and waits to be stopped
import os, signal, sys, time
out = sys.argv[sys.argv.index("--out") + 1]
if "rROUND_" in out:
    open(out + ".lock", "w").close()
    os.kill(os.getppid(), signal.SIG)
    time.sleep(60)
serve(out)
"""


def _signal_arm(tmp_path, monkeypatch, sig: str, rnd: int):
    gen = SIGNAL_GENERATE.replace("ROUND", f"{rnd:03d}").replace("signal.SIG", f"signal.{sig}")
    return _fake_checkout_arm(tmp_path, monkeypatch, gen, "  label: a\n")


def test_sigterm_mid_soak_writes_the_finished_rounds_and_refuses_a_rerun(
        tmp_path, monkeypatch, capsys):
    """SIGTERM in round 1 ended the soak (Ray's driver handler: exit 15) with no summary of
    round 0 and the cut round's lock file left in rounds/. Now it stops as Ctrl-C does:
    summary.json and report.html of the finished round, marked interrupted, no lock left,
    the kept-rounds line, exit 143; a rerun on that --out is refused, saying how to start
    over (a soak is not resumed)."""
    from cluster.cli import main
    cfg = _signal_arm(tmp_path, monkeypatch, "SIGTERM", 1)
    out = tmp_path / "soak"
    args = ["soak", "--config", str(cfg), "--prompts", str(_prompts(tmp_path)), "--rounds", "3",
            "--out", str(out)]
    t0 = runner.time.monotonic()
    assert main(args) == 143
    assert runner.time.monotonic() - t0 < 30  # (the cut round was not waited for)
    err = capsys.readouterr().err
    assert err.endswith(
        f"kvfleet soak: stopped by SIGTERM; the 1 rounds that finished are in {out}/summary.json "
        f"and {out}/report.html (marked interrupted; round 1 arm A was cut and is left out), "
        f"their files in {out / 'rounds'}; a soak is not resumed: give another --out, or "
        f"remove {out} to start over\n"), err
    s = json.loads((out / "summary.json").read_text())
    assert s["interrupted"] == {"signal": "SIGTERM", "rounds_kept": 1, "cut_round": 1,
                                "cut_arm": "A"}
    assert s["rounds"] == 1 and s["faults"]["lost_requests"] == 0
    assert len(pd.read_parquet(out / "requests.parquet")) == 4
    assert (out / "report.html").exists()
    assert not list((out / "rounds").glob("*.lock"))
    assert (out / "rounds" / "r001_A.log").exists()  # (the cut round's log stays)
    assert runner.signal.getsignal(runner.signal.SIGTERM) is not runner.stop_on_sigterm
    assert main(args) == 2
    assert capsys.readouterr().err == (
        f"kvfleet soak: error: --out {out}: holds a soak interrupted by SIGTERM after 1 rounds "
        f"(its summary.json and report.html are of those); a soak is not resumed; give "
        f"another --out, or remove it (rm -r {out}) to start over\n")


def test_ctrl_c_before_any_round_finished_leaves_the_out_reusable(tmp_path, monkeypatch, capsys):
    """Ctrl-C in the first round left an empty OUT/rounds/, said 'the rounds that finished
    are kept' (none had), and a rerun was refused as 'not a new or empty directory'."""
    from cluster.cli import main
    cfg = _signal_arm(tmp_path, monkeypatch, "SIGINT", 0)
    out = tmp_path / "soak"
    args = ["soak", "--config", str(cfg), "--prompts", str(_prompts(tmp_path)), "--rounds", "1",
            "--out", str(out)]
    assert main(args) == 130
    assert capsys.readouterr().err.endswith(
        f"kvfleet soak: interrupted; no round had finished: nothing was kept, and --out {out} "
        "can be given again\n")
    assert not out.exists()
    out.mkdir()  # (an empty --out given: left there, empty)
    assert main(args) == 130 and list(out.iterdir()) == []
    capsys.readouterr()
    cfg.write_text(cfg.read_text().replace("working_dir: build", "working_dir: served"))
    served = tmp_path / "served" / "cluster"
    served.mkdir(parents=True)
    (served / "__main__.py").write_text(SIGNAL_GENERATE.replace("ROUND", "999"))
    assert main(args) == 0, capsys.readouterr().err
