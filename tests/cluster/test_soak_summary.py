"""Soak summary arithmetic on hand-made tables (the end-to-end soak has its own test)."""
from types import SimpleNamespace

import numpy as np
import pandas as pd

from cluster.soak.summary import apply_gate, first_difference, parity_table, summarize


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([], []) is None


def _tables():
    rounds = pd.DataFrame({
        "round": [0, 0, 1, 1, 2, 2], "arm": list("ABABAB"),
        "throughput_tok_s": [100.0, 90.0, 120.0, 60.0, 80.0, 84.0],
        "ttft_median_s": [0.1, 0.2, 0.1, 0.1, 0.2, 0.1],
        "kills": [0, 0, 1, 0, 0, 0], "recoveries": [0, 0, 1, 0, 0, 0],
        "lost_requests": [0, 0, 0, 0, 0, 0], "errors": [0, 0, 0, 0, 0, 2],
    })
    req = []
    for r in range(3):
        for arm in "AB":
            for i in range(2):
                toks = [1, 2, 3, 4]
                if arm == "B" and r == 1 and i == 1:
                    toks = [1, 2, 7, 4]
                req.append({"round": r, "arm": arm, "id": f"p{i}", "line": i + 1,
                            "completion_tokens": toks,
                            "finish_reason": "length", "ttft_s": 0.1 + i, "decode_tokens_per_s": 10.0,
                            "temperature": 0.0})
    return pd.DataFrame(req), rounds


def test_summary_ratios_pair_by_pair_and_parity():
    requests, rounds = _tables()
    s = summarize(requests, rounds)
    # ratios per round: 0.9, 0.5, 1.05 -> median 0.9 (not 234/300 of the totals)
    t = s["ratio_B_over_A"]["throughput_tok_s"]
    assert np.isclose(t["median"], 0.9) and np.isclose(t["min"], 0.5) and np.isclose(t["max"], 1.05)
    assert s["metrics"]["A"]["throughput_tok_s"]["median"] == 100.0
    assert s["parity"] == {"greedy": True, "compared": 6, "sampled": 0, "breaks": 1,
                           "first_diff_min": 2}
    assert s["faults"] == {"kills": 1, "recoveries": 1, "lost_requests": 0}
    par = parity_table(requests)
    assert par.loc[(par["round"] == 1) & (par.id == "p1"), "first_diff"].item() == 2


def test_gate_names_the_failing_metric():
    requests, rounds = _tables()
    s = summarize(requests, rounds)
    gate = SimpleNamespace(min_throughput_ratio=0.95, max_parity_breaks=0, max_lost_requests=0,
                           max_errors=1, max_failed_rounds=0)
    fails = [str(f) for f in apply_gate(s, gate)]
    assert any(f.startswith("throughput ratio B/A (median) = 0.9 < 0.95") for f in fails)
    assert any(f.startswith("greedy parity breaks = 1 > 0") for f in fails)
    assert any("errors per round (B) = 2 > 1" in f for f in fails)
    lenient = SimpleNamespace(min_throughput_ratio=0.5, max_parity_breaks=1, max_lost_requests=0,
                              max_errors=None,
                           max_failed_rounds=None)
    assert apply_gate(s, lenient) == []


def test_parity_keys_lines_so_error_rows_without_an_id_do_not_collide():
    """Two input-error rows of one round have no id (a malformed line, a duplicate id): the
    parity table pairs A and B by line, compares neither, and still pairs the good rows."""
    rows = []
    for arm in "AB":
        rows += [{"round": 0, "arm": arm, "id": "p0", "line": 1, "completion_tokens": [1, 2],
                  "finish_reason": "length", "temperature": 0.0},
                 {"round": 0, "arm": arm, "id": None, "line": 2, "completion_tokens": [],
                  "finish_reason": "error", "temperature": 0.0},
                 {"round": 0, "arm": arm, "id": None, "line": 3, "completion_tokens": [],
                  "finish_reason": "error", "temperature": 0.0}]
    rows[3]["completion_tokens"] = [1, 5]  # B's p0 differs at token 1
    par = parity_table(pd.DataFrame(rows))
    assert len(par) == 3 and int(par.compared.sum()) == 1
    assert par.loc[par.compared, "first_diff"].item() == 1


def test_gate_fails_when_no_round_measured_the_throughput_ratio():
    """Arm B (a new build) crashed in every round and left no stats: its throughput is None,
    so there is no ratio. With lost requests tolerated the gate passed on no data at all."""
    requests, rounds = _tables()
    rounds.loc[rounds.arm == "B", "throughput_tok_s"] = None
    s = summarize(requests, rounds)
    assert s["ratio_B_over_A"]["throughput_tok_s"]["median"] is None
    gate = SimpleNamespace(min_throughput_ratio=0.95, max_parity_breaks=None, max_lost_requests=None,
                           max_errors=None,
                           max_failed_rounds=None)
    assert [str(f) for f in apply_gate(s, gate)] == [
        "throughput ratio B/A (median) = missing (no data to check against 0.95)"]
    off = SimpleNamespace(min_throughput_ratio=None, max_parity_breaks=None, max_lost_requests=None,
                          max_errors=None,
                           max_failed_rounds=None)
    assert apply_gate(s, off) == []  # a disabled rule stays off
    one_arm = summarize(requests[requests.arm == "A"], rounds[rounds.arm == "A"])
    assert apply_gate(one_arm, gate) == []  # no B arm: no ratio to ask for


def test_gate_fails_greedy_parity_when_nothing_was_compared():
    """A's p1 and B's p0 an error in every round: no prompt-round compared, 0 breaks; the
    parity rule passed. (Each arm served some line, so the success rule stays quiet.)"""
    requests, rounds = _tables()
    requests.loc[(requests.arm == "A") & (requests.id == "p1"), "finish_reason"] = "error"
    requests.loc[(requests.arm == "B") & (requests.id == "p0"), "finish_reason"] = "error"
    s = summarize(requests, rounds)
    assert s["parity"]["compared"] == 0 and s["parity"]["breaks"] == 0
    gate = SimpleNamespace(min_throughput_ratio=None, max_parity_breaks=0, max_lost_requests=None,
                           max_errors=None,
                           max_failed_rounds=None)
    assert [str(f) for f in apply_gate(s, gate)] == [
        "greedy parity breaks = missing (no data to check against 0)"]
    sampled = requests.assign(temperature=0.7)
    assert apply_gate(summarize(sampled, rounds), gate) == []  # nothing greedy: no rule


def test_a_failed_round_fails_the_gate_even_with_nothing_lost():
    """B's run of round 1 crashed (exit 1) after every request was served, and A's round 2 was
    killed (signal 9) after it had flushed all its rows: no lost request, no error row, and the
    gate passed on both; the return code entered neither the summary nor the gate."""
    requests, rounds = _tables()
    rounds["returncode"] = ["0", "0", "0", "1", "-9", "0"]
    rounds["failed"] = rounds.returncode != "0"
    s = summarize(requests, rounds)
    assert s["faults"]["failed_rounds"] == 2 and s["faults"]["lost_requests"] == 0
    assert s["failed_rounds"] == [{"round": 1, "arm": "B", "returncode": "1", "runtime_errors": 0},
                                  {"round": 2, "arm": "A", "returncode": "-9", "runtime_errors": 0}]
    assert s["metrics"]["A"]["failed_rounds"] == 1 and s["metrics"]["B"]["failed_rounds"] == 1
    gate = SimpleNamespace(min_throughput_ratio=None, max_parity_breaks=None, max_lost_requests=0,
                           max_errors=None, max_failed_rounds=0)
    assert [str(f) for f in apply_gate(s, gate)] == [
        "failed rounds (round 1 B: exit status 1, round 2 A: killed by signal 9) = 2 > 0"]
    assert apply_gate(s, SimpleNamespace(**{**vars(gate), "max_failed_rounds": 2})) == []
    assert apply_gate(s, SimpleNamespace(**{**vars(gate), "max_failed_rounds": None})) == []
    rounds["returncode"], rounds["failed"] = "0", False
    ok = summarize(requests, rounds)
    assert ok["faults"]["failed_rounds"] == 0 and apply_gate(ok, gate) == []


def test_parity_follows_each_lines_own_temperature():
    """The job's temperature decided parity for every line: a greedy job's lines that set
    temperature 0.8 were compared token for token (their draws differ between builds: false
    breaks, a failed gate), and a sampled job's lines that set 0 were never compared."""
    requests, rounds = _tables()
    # p1 samples (its own temperature in both arms); p1's B tokens differ in round 1
    requests.loc[requests.id == "p1", "temperature"] = 0.8
    s = summarize(requests, rounds)
    assert s["parity"] == {"greedy": True, "compared": 3, "sampled": 3, "breaks": 0,
                           "first_diff_min": None}
    par = parity_table(requests)
    assert par[par.id == "p1"].sampled.all() and not par[par.id == "p1"].compared.any()
    assert par[par.id == "p1"].first_diff.isna().all()
    gate = SimpleNamespace(min_throughput_ratio=None, max_parity_breaks=0, max_lost_requests=None,
                           max_errors=None, max_failed_rounds=None)
    assert apply_gate(s, gate) == []
    # sampled in one arm only (B's job temperature applies to a line without its own): not compared
    requests.loc[requests.id == "p1", "temperature"] = 0.0
    requests.loc[(requests.id == "p1") & (requests.arm == "B"), "temperature"] = 0.5
    assert summarize(requests, rounds)["parity"]["sampled"] == 3
    # a sampled job whose greedy lines (temperature 0 on the line) break parity: they are compared
    requests["temperature"] = 0.9
    requests.loc[requests.id == "p1", "temperature"] = 0.0
    s = summarize(requests, rounds)
    assert s["parity"] == {"greedy": True, "compared": 3, "sampled": 3, "breaks": 1,
                           "first_diff_min": 2}
    assert [str(f) for f in apply_gate(s, gate)] == ["greedy parity breaks = 1 > 0"]


def test_performance_figures_come_from_completed_rounds_only():
    """B's run of round 1 crashed after serving its rows slowly (throughput 60, TTFT 9 s, one
    error row). Its partial figures entered B's medians and the B/A ratios (0.5 pulled the
    throughput ratio's min and median); now only completed rounds, and pairs of them, count
    there, while its rows and error still count in the accounting."""
    requests, rounds = _tables()
    rounds["returncode"] = ["0", "0", "0", "1", "0", "0"]
    rounds["failed"] = rounds.returncode != "0"
    rounds.loc[3, "errors"] = 3
    crashed = (requests["round"] == 1) & (requests.arm == "B")
    requests.loc[crashed, "ttft_s"] = 9.0
    s = summarize(requests, rounds)
    t = s["ratio_B_over_A"]["throughput_tok_s"]
    assert np.isclose(t["median"], (0.9 + 1.05) / 2) and np.isclose(t["min"], 0.9) and t["n"] == 2
    b = s["metrics"]["B"]
    assert b["throughput_tok_s"] == {"median": 87.0, "min": 84.0, "max": 90.0, "n": 2}
    assert b["request_ttft_s"]["max"] < 9.0 and b["request_ttft_s"]["n"] == 4
    assert b["completed_rounds"] == 2 and b["failed_rounds"] == 1
    assert s["metrics"]["A"]["completed_rounds"] == 3
    assert s["metrics"]["A"]["throughput_tok_s"]["n"] == 3  # A's round 1 completed: it counts
    # accounting keeps the failed round: its errors (the gate's max_errors) and its compared rows
    assert b["errors"]["max"] == 3 and b["errors"]["n"] == 3
    assert s["parity"]["compared"] == 6 and s["parity"]["breaks"] == 1
    gate = SimpleNamespace(min_throughput_ratio=0.95, max_parity_breaks=None, max_lost_requests=0,
                           max_errors=2, max_failed_rounds=None)
    assert [str(f) for f in apply_gate(s, gate)] == ["errors per round (B) = 3 > 2"]


def _gate(**rules):
    """The gate with every rule off but the ones given."""
    off = dict(min_throughput_ratio=None, max_parity_breaks=None, max_lost_requests=None,
               max_errors=None, max_failed_rounds=None)
    return SimpleNamespace(**{**off, **rules})


def _all_invalid(arms="A"):
    """Every prompt line invalid (malformed JSON, a duplicate id): each round's rows are all
    input-error rows, which count as served, so nothing is lost and no round failed."""
    requests = pd.DataFrame([{"round": r, "arm": arm, "id": None, "line": n, "completion_tokens": [],
                              "finish_reason": "error", "error": f"line {n}: malformed JSON",
                              "ttft_s": None, "decode_tokens_per_s": None, "temperature": 0.0}
                             for r in range(2) for arm in arms for n in (1, 2)])
    rounds = pd.DataFrame([{"round": r, "arm": arm, "throughput_tok_s": 0.0, "errors": 2,
                            "kills": 0, "recoveries": 0, "lost_requests": 0, "returncode": "0",
                            "failed": False} for r in range(2) for arm in arms])
    return requests, rounds


def test_an_arm_that_served_no_request_successfully_fails_the_gate():
    """A soak whose prompt lines were all invalid passed the default single-arm gate
    (max_errors is null by default): nothing lost, no failed round, no ratio to ask for."""
    from cluster.soak.config import SoakGate
    requests, rounds = _all_invalid()
    s = summarize(requests, rounds)
    assert s["metrics"]["A"]["ok_requests"] == 0
    want = ["successful requests (A: no request of any round finished with stop or length) = 0 < 1"]
    assert [str(f) for f in apply_gate(s, SoakGate())] == want
    assert [str(f) for f in apply_gate(s, _gate())] == want  # whatever the other rules say
    # one good row in one round is enough for this rule (max_errors is there for the rest)
    requests.loc[0, "finish_reason"] = "stop"
    s = summarize(requests, rounds)
    assert s["metrics"]["A"]["ok_requests"] == 1 and apply_gate(s, SoakGate()) == []


def test_the_success_rule_names_the_arm_that_served_nothing():
    requests, rounds = _tables()
    requests.loc[requests.arm == "B", "finish_reason"] = "error"
    s = summarize(requests, rounds)
    assert s["metrics"]["A"]["ok_requests"] == 6 and s["metrics"]["B"]["ok_requests"] == 0
    assert [str(f) for f in apply_gate(s, _gate())] == [
        "successful requests (B: no request of any round finished with stop or length) = 0 < 1"]


def test_parity_fails_when_an_arm_served_no_rows_at_all():
    """B's rounds served no row at all (its rows never written; lost requests tolerated):
    the parity table had no A/B pair, so `greedy` came out False and the parity rule was
    skipped, while the gate fails any other rule with nothing to check."""
    requests, rounds = _tables()
    requests = requests[requests.arm == "A"]
    rounds.loc[rounds.arm == "B", "lost_requests"] = 2
    s = summarize(requests, rounds)
    assert s["parity"]["greedy"] is None and s["parity"]["compared"] == 0
    fails = [str(f) for f in apply_gate(s, _gate(max_parity_breaks=0))]
    assert ("greedy parity breaks (not evaluated: no prompt-round was served by both arms) = "
            "missing (no data to check against 0)") in fails
    # with the parity rule off, only B's having served nothing is left
    assert [str(f) for f in apply_gate(s, _gate())] == [
        "successful requests (B: no request of any round finished with stop or length) = 0 < 1"]
    # an arm that served only sampled lines still tells parity there was nothing greedy
    both = _tables()[0].assign(temperature=0.7)
    assert summarize(both, rounds)["parity"]["greedy"] is False


def test_gate_rules_fail_on_missing_or_nan_data():
    """Each rule passed when its input was absent: lost requests read as 0 without a
    `lost_requests` column, an arm without `errors` skipped max_errors, no `failed` column
    skipped max_failed_rounds; a NaN figure compared False against every limit."""
    requests, rounds = _tables()
    s = summarize(requests, rounds.drop(columns=["lost_requests", "errors"]))
    assert [str(f) for f in apply_gate(s, _gate(max_lost_requests=0, max_errors=0,
                                                max_failed_rounds=0))] == [
        "lost requests = missing (no data to check against 0)",
        "errors per round (A) = missing (no data to check against 0)",
        "errors per round (B) = missing (no data to check against 0)",
        "failed rounds = missing (no data to check against 0)"]
    s = summarize(requests, rounds)
    s["ratio_B_over_A"]["throughput_tok_s"]["median"] = float("nan")
    s["faults"]["lost_requests"] = float("nan")
    s["metrics"]["B"]["errors"]["max"] = float("nan")
    assert [str(f) for f in apply_gate(s, _gate(min_throughput_ratio=0.5, max_lost_requests=0,
                                                max_errors=5))] == [
        "throughput ratio B/A (median) = missing (no data to check against 0.5)",
        "lost requests = missing (no data to check against 0)",
        "errors per round (B) = missing (no data to check against 5)"]


def test_stats_leave_out_nan_inf_and_na_of_any_type():
    """The NaN filter knew only Python floats: an np.float32 NaN gave a NaN median (which
    compares False against every gate limit), an infinity stayed in, and pd.NA raised."""
    from cluster.soak.summary import _stats
    assert _stats([np.float32("nan"), np.float32(1.0), 3.0, np.inf]) == {
        "median": 2.0, "min": 1.0, "max": 3.0, "n": 2}
    assert _stats([None, pd.NA, float("nan"), -np.inf])["median"] is None
    assert _stats(pd.Series([4, None], dtype="Int64")) == {"median": 4.0, "min": 4.0, "max": 4.0, "n": 1}


def test_counters_are_summed_per_arm_failed_rounds_included():
    """A fallback path or saved-KV event only one arm's runs counted is a column the other
    arm's rounds lack (NaN): it sums to that arm alone; a failed round counts too."""
    requests, rounds = _tables()
    rounds["failed"] = [False, False, False, True, False, False]
    rounds["returncode"] = ["0", "0", "0", "1", "0", "0"]
    rounds["worker_deaths"] = [0, 0, 1, 2, 0, 0]
    rounds["requeued"] = [0, 0, 4, 3, 0, 0]
    rounds["runtime_errors"] = [0, 0, 0, 5, 0, np.nan]  # (a row from a table without it)
    rounds["fallbacks.cpu.polar_rebuild_rows"] = [np.nan, 7, np.nan, 7, np.nan, 7]
    rounds["kv_cache.hits"] = [1, np.nan, 1, np.nan, 0, np.nan]
    s = summarize(requests, rounds)
    assert s["metrics"]["A"]["counters"] == {
        "worker_deaths": 1, "recoveries": 1, "requeued": 4, "runtime_errors": 0,
        "fallbacks": {}, "kv_cache": {"hits": 2}}
    assert s["metrics"]["B"]["counters"] == {
        "worker_deaths": 2, "recoveries": 0, "requeued": 3, "runtime_errors": 5,
        "fallbacks": {"cpu.polar_rebuild_rows": 21}, "kv_cache": {}}
    assert s["failed_rounds"] == [{"round": 1, "arm": "B", "returncode": "1", "runtime_errors": 5}]
