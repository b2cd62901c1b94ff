"""`kvfleet soak` end to end on the tiny model: f32 against kv8 for two rounds, then a run
with a worker killed every few seconds."""
from __future__ import annotations

import json

import pandas as pd
import pytest
import yaml

from cluster.cli import main
from runtime_helpers import make_tiny, prompt_lines, write_lines

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("soak")
    model = make_tiny(d / "model")
    prompts = write_lines(d / "prompts.jsonl", prompt_lines(6, seed=3, max_tokens=5))
    base = {"model": str(model), "slots": 4, "max_context": 256,
            "workers": {"count": 1, "num_cpus": 0.5}}
    a = d / "f32.yaml"
    a.write_text(yaml.safe_dump({**base, "kv": "f32", "soak": {
        "label": "f32", "gate": {"min_throughput_ratio": 0.05, "max_parity_breaks": 6,
                                 "max_lost_requests": 0}}}))
    b = d / "kv8.yaml"
    b.write_text(yaml.safe_dump({**base, "kv": "kv8", "soak": {"label": "kv8"}}))
    return d, prompts, a, b


def test_two_round_ab_soak_records_every_field(setup, monkeypatch):
    d, prompts, a, b = setup
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    out = d / "ab"
    code = main(["soak", "--config", str(a), "--vs", str(b), "--prompts", str(prompts),
                 "--rounds", "2", "--out", str(out)])
    assert code == 0
    rounds = pd.read_parquet(out / "rounds.parquet")
    assert list(rounds.arm) == ["A", "B", "A", "B"] and list(rounds["round"]) == [0, 0, 1, 1]
    assert (rounds.start_s.diff().dropna() > 0).all()  # interleaved in time order
    for col in ("throughput_tok_s", "ttft_median_s", "decode_tok_s_median", "tokens_per_forward",
                "kv_bytes", "rss_bytes", "expert_pins", "expert_hit_rate"):
        assert rounds[col].notna().all() and (rounds[col] > 0).all(), col
    assert (rounds.errors == 0).all() and (rounds.lost_requests == 0).all()
    # kv8 holds the same tokens in ~1/3.9 of the bytes
    ratio = rounds[rounds.arm == "B"].kv_bytes.values / rounds[rounds.arm == "A"].kv_bytes.values
    assert ((ratio > 0.2) & (ratio < 0.3)).all()
    req = pd.read_parquet(out / "requests.parquet")
    assert len(req) == 2 * 2 * 6 and set(req.id) == {f"q{i}" for i in range(6)}
    assert (req.temperature == 0.0).all()  # the temperature each line ran at (parity is per line)
    s = json.loads((out / "summary.json").read_text())
    assert s["rounds"] == 2 and s["arms"] == ["A", "B"]
    for arm in "AB":
        m = s["metrics"][arm]["throughput_tok_s"]
        assert m["min"] <= m["median"] <= m["max"] and m["n"] == 2
        assert s["metrics"][arm]["counters"] == {"worker_deaths": 0, "recoveries": 0,
                                                 "requeued": 0, "runtime_errors": 0,
                                                 "fallbacks": {}, "kv_cache": {}}
    r = s["ratio_B_over_A"]["kv_bytes"]
    assert 0.2 < r["median"] < 0.3
    assert s["parity"]["compared"] == 12 and s["parity"]["greedy"] is True
    assert s["parity"]["sampled"] == 0
    assert s["faults"] == {"kills": 0, "kills_unseen": 0, "kills_unknown": 0, "kills_after_end": 0,
                           "recoveries": 0, "lost_requests": 0, "failed_rounds": 0}
    assert s["failed_rounds"] == [] and rounds.failed.tolist() == [False] * 4
    assert s["gate"]["passed"] is True
    html = (out / "report.html").read_text()
    assert html.count("<img") == 4 and "f32 vs kv8" in html


def test_gate_failure_exits_nonzero_and_names_the_metric(setup, capsys, monkeypatch):
    d, prompts, a, b = setup
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    strict = d / "strict.yaml"
    cfg = yaml.safe_load(a.read_text())
    cfg["soak"]["gate"] = {"min_throughput_ratio": 50.0}
    strict.write_text(yaml.safe_dump(cfg))
    code = main(["soak", "--config", str(strict), "--vs", str(b), "--prompts", str(prompts),
                 "--rounds", "1", "--out", str(d / "strict")])
    assert code == 1
    assert "FAILED: throughput ratio B/A (median)" in capsys.readouterr().out


def test_soak_with_worker_kills_loses_nothing(setup, monkeypatch):
    d, prompts, a, _ = setup
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    two = d / "two-workers.yaml"
    cfg = yaml.safe_load(a.read_text())
    cfg["workers"]["count"] = 2
    cfg["sampling"] = {"max_tokens": 64}
    two.write_text(yaml.safe_dump(cfg))
    many = write_lines(d / "many.jsonl", prompt_lines(40, seed=5, max_tokens=64))
    out = d / "kills"
    code = main(["soak", "--config", str(two), "--prompts", str(many), "--rounds", "2",
                 "--out", str(out), "--kill-worker-every", "1s"])
    s = json.loads((out / "summary.json").read_text())
    assert s["faults"]["kills"] >= 1
    assert s["faults"]["lost_requests"] == 0
    assert s["faults"]["recoveries"] >= 1
    assert s["faults"]["failed_rounds"] == 0  # a worker kill the job recovers from fails no round
    c = s["metrics"]["A"]["counters"]
    assert c["worker_deaths"] >= c["recoveries"] == s["faults"]["recoveries"]
    # a kill after its round's last step is seen by none: counted apart, not as a kill
    faults = pd.read_parquet(out / "faults.parquet")
    assert s["faults"]["kills"] == int((~faults.after_end).sum())
    assert s["faults"]["kills_after_end"] == int(faults.after_end.sum())
    # every kill has an outcome; those the job found are at most its deaths
    assert set(faults.outcome) <= {"found", "unseen", "after_end"}
    assert int((faults.outcome == "found").sum()) <= c["worker_deaths"]
    assert s["faults"]["kills_unseen"] == int((faults.outcome == "unseen").sum())
    assert c["requeued"] >= 0 and c["runtime_errors"] == 0
    assert code == 0
    req = pd.read_parquet(out / "requests.parquet")
    for _, g in req.groupby("round"):
        assert sorted(g.id) == sorted(f"q{i}" for i in range(40))  # every id exactly once
    # kills land at different moments in the two rounds; greedy completions must not care
    by_round = [g.set_index("id").completion_tokens.map(list) for _, g in req.groupby("round")]
    assert by_round[0].sort_index().tolist() == by_round[1].sort_index().tolist()


def test_a_round_whose_rows_fail_at_run_time_is_a_failed_round(setup, monkeypatch):
    """The lone worker's first step outlives its step timeout (1 us): RayGroup takes it as
    hung and kills it, and every row fails with 'no live worker left'. The round's generate
    exited 0, so the round counted as completed; now generate exits 1 and the round fails,
    with its count and the scheduler counters of its --stats in the summary."""
    d, prompts, a, _ = setup
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    hung = d / "hung.yaml"
    cfg = yaml.safe_load(a.read_text())
    cfg["workers"]["step_timeout_s"] = 1e-6
    cfg["soak"]["gate"] = {"max_failed_rounds": 0}
    hung.write_text(yaml.safe_dump(cfg))
    out = d / "hung"
    code = main(["soak", "--config", str(hung), "--prompts", str(prompts), "--rounds", "1",
                 "--out", str(out)])
    assert code == 1
    log = (out / "rounds" / "r000_A.log").read_text()
    assert "kvfleet generate: 6 of 6 rows failed at run time" in log, log[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["failed_rounds"] == [{"round": 0, "arm": "A", "returncode": "1", "runtime_errors": 6}]
    assert "failed rounds (round 0 A: exit status 1, 6 rows failed at run time) = 1 > 0" in \
        s["gate"]["failures"]
    rounds = pd.read_parquet(out / "rounds.parquet")
    assert rounds.failed.tolist() == [True] and rounds.runtime_errors.tolist() == [6]
    c = s["metrics"]["A"]["counters"]
    assert c["runtime_errors"] == 6 and c["worker_deaths"] == 1 and c["recoveries"] == 0
    stats = json.loads((out / "rounds" / "r000_A.stats.json").read_text())
    assert stats["runtime_errors"] == 6 and stats["errors"] == 6


def test_an_arm_that_fell_back_is_named_on_stderr(setup, capsys, monkeypatch):
    """B's rounds ran polar3 through the numpy row rebuild (cpu.polar_rebuild_rows) and the
    soak said only 'gate passed': the warning was in the round's own log alone."""
    d, prompts, a, _ = setup
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    polar = d / "polar3.yaml"
    cfg = yaml.safe_load(a.read_text())
    cfg.update(kv="polar3", soak={"label": "polar3"})
    polar.write_text(yaml.safe_dump(cfg))
    main(["soak", "--config", str(a), "--vs", str(polar), "--prompts", str(prompts),
          "--rounds", "1", "--out", str(d / "fell")])
    err = capsys.readouterr().err
    n = json.loads((d / "fell" / "summary.json").read_text())["metrics"]["B"]["counters"][
        "fallbacks"]["cpu.polar_rebuild_rows"]
    assert n > 0
    assert (f"soak: warning: arm B (polar3) fell back from native paths in its rounds: "
            f"cpu.polar_rebuild_rows {n}x") in err
    assert "arm A (f32) fell back" not in err


def test_sigterm_mid_soak_keeps_the_finished_rounds(setup, tmp_path):
    """`kvfleet soak ... & kill -TERM $!` in round 1: Ray's driver handler ended it with exit
    15 and no summary.json or report of round 0, the cut round's lock file stayed in rounds/,
    and a rerun on that --out was refused as merely used. Now: exit 143, the finished rounds'
    summary (marked interrupted) and report, no lock left, one line saying what was kept."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from runtime_helpers import ROOT
    d, prompts, a, _ = setup
    out = tmp_path / "t2"
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster", "soak", "--config", str(a), "--prompts", str(prompts),
         "--rounds", "4", "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"})
    try:
        deadline = time.monotonic() + 240
        while True:  # until a round after the first has its run going (it holds its lock)
            locks = [p for p in (out / "rounds").glob("r00[123]_A.parquet.lock")]
            if locks:
                break
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        cut = int(locks[0].name[1:4])
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["interrupted"] == {"signal": "SIGTERM", "rounds_kept": cut, "cut_round": cut,
                                "cut_arm": "A"}, err[-3000:]
    assert s["rounds"] == cut and s["faults"]["lost_requests"] == 0
    assert (out / "report.html").exists()
    assert not list((out / "rounds").glob("*.lock"))
    assert err.splitlines()[-1] == (
        f"kvfleet soak: stopped by SIGTERM; the {cut} rounds that finished are in "
        f"{out}/summary.json and {out}/report.html (marked interrupted; round {cut} arm A was "
        f"cut and is left out), their files in {out / 'rounds'}; a soak is not resumed: give "
        f"another --out, or remove {out} to start over")
