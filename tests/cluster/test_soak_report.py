"""The soak report renders in a real headless browser: no errors, every plot decoded."""
import json
import re

import numpy as np
import pandas as pd

from cluster.soak.report import write_report
from cluster.soak.summary import parity_table, summarize
from browser import load_page


def test_report_loads_in_chromium_with_its_plots(tmp_path):
    rng = np.random.default_rng(0)
    n = 4
    rounds = pd.DataFrame({
        "round": np.repeat(np.arange(n), 2), "arm": ["A", "B"] * n,
        "start_s": np.arange(2 * n) * 3.0 + 1000, "end_s": np.arange(2 * n) * 3.0 + 1002.5,
        "throughput_tok_s": rng.uniform(80, 120, 2 * n), "ttft_median_s": rng.uniform(0.1, 0.3, 2 * n),
        "decode_tok_s_median": rng.uniform(10, 20, 2 * n), "rss_bytes": rng.uniform(1e9, 2e9, 2 * n),
        "kv_bytes": rng.uniform(1e6, 2e6, 2 * n), "kills": [0, 0, 1, 0, 0, 0, 0, 0],
        "recoveries": [0, 0, 1, 0, 0, 0, 0, 0], "lost_requests": 0, "errors": 0})
    requests = pd.DataFrame([{"round": r, "arm": a, "id": f"p{i}", "line": i + 1,
                              "completion_tokens": [1, 2, i + (a == "B")],
                              "finish_reason": "length", "ttft_s": 0.1, "decode_tokens_per_s": 12.0,
                              "temperature": 0.0}
                             for r in range(n) for a in "AB" for i in range(3)])
    faults = pd.DataFrame({"time_s": [1007.0], "worker": ["w0"]})
    s = summarize(requests, rounds)
    s["gate"] = {"passed": False, "failures": ["greedy parity breaks = 12 > 0"]}
    out = tmp_path / "report.html"
    write_report(out, s, rounds, parity_table(requests), faults, "soak: f32 vs kv8")
    page = out.read_text()
    assert "http://" not in page and "https://" not in page  # self-contained
    dom, errors = load_page(out, tmp_path / "shot.png")
    assert errors == []
    loaded = re.search(r'data-plots-loaded="(\d+)"', dom)
    assert loaded and int(loaded.group(1)) == 4 == page.count("<img")
    assert "gate: FAIL: greedy parity breaks" in dom
    assert (tmp_path / "shot.png").stat().st_size > 20_000  # a real rendering, not a blank page


def test_report_counts_only_the_compared_prompt_rounds(tmp_path):
    """A pair with an error row is not compared: the report said 3 compared where the summary
    (parity.compared) said 1."""
    rounds = pd.DataFrame({"round": [0, 0], "arm": ["A", "B"], "start_s": [0.0, 2.0],
                           "end_s": [1.0, 3.0], "throughput_tok_s": [100.0, 90.0],
                           "ttft_median_s": [0.1, 0.1], "decode_tok_s_median": [10.0, 9.0],
                           "rss_bytes": [1e9, 1e9], "kv_bytes": [1e6, 1e6], "errors": [0, 2],
                           "kills": 0, "recoveries": 0, "lost_requests": [0, 2]})
    requests = pd.DataFrame([{"round": 0, "arm": a, "id": f"p{i}", "line": i + 1,
                              "completion_tokens": [1, 2],
                              "finish_reason": "error" if (a == "B" and i) else "length",
                              "ttft_s": 0.1, "decode_tokens_per_s": 10.0, "temperature": 0.0}
                             for a in "AB" for i in range(3)])
    s = summarize(requests, rounds)
    out = tmp_path / "report.html"
    write_report(out, s, rounds, parity_table(requests), pd.DataFrame(columns=["time_s"]), "t")
    assert s["parity"]["compared"] == 1
    assert "<p>1 prompt-rounds compared, 0 differ;" in out.read_text()


def test_report_lists_the_failed_rounds(tmp_path):
    """A round whose run exited non-zero or timed out is named in the report (with how it
    ended and its log) and marked on the timeline; the report said nothing of it."""
    rounds = pd.DataFrame({"round": [0, 0, 1, 1], "arm": list("ABAB"),
                           "start_s": [0.0, 2.0, 4.0, 6.0], "end_s": [1.0, 3.0, 5.0, 7.0],
                           "throughput_tok_s": [100.0, None, 100.0, 95.0],
                           "ttft_median_s": 0.1, "decode_tok_s_median": 10.0, "rss_bytes": 1e9,
                           "kv_bytes": 1e6, "errors": 0, "kills": 0, "recoveries": 0,
                           "lost_requests": [0, 3, 0, 0],
                           "returncode": ["0", "-9", "0", "timeout"]})
    rounds["failed"] = rounds.returncode != "0"
    requests = pd.DataFrame([{"round": r, "arm": a, "id": "p0", "line": 1, "completion_tokens": [1],
                              "finish_reason": "length", "ttft_s": 0.1, "decode_tokens_per_s": 10.0,
                              "temperature": 0.0}
                             for r in range(2) for a in "AB"])
    s = summarize(requests, rounds)
    out = tmp_path / "report.html"
    write_report(out, s, rounds, parity_table(requests), pd.DataFrame(columns=["time_s"]), "t")
    page = out.read_text()
    # every B round failed: no completed pair, so no ratio plot (it showed B's partial figures)
    assert "failed rounds: 2" in page and page.count("<img") == 3
    assert "no B/A ratios: no round had both its A and its B run completed" in page
    assert "the per-arm medians and the B/A ratios come from completed rounds only" in page
    assert "<td>0</td><td>B</td><td>killed by signal 9</td><td>rounds/r000_B.log</td>" in page
    assert "<td>1</td><td>B</td><td>timed out</td>" in page
    rounds["failed"], rounds["returncode"] = False, "0"
    write_report(out, summarize(requests, rounds), rounds, parity_table(requests),
                 pd.DataFrame(columns=["time_s"]), "t")
    assert "none: every round's run exited 0" in out.read_text()


def test_report_says_sampled_lines_are_not_compared(tmp_path):
    rounds = pd.DataFrame({"round": [0, 0], "arm": ["A", "B"], "start_s": [0.0, 2.0],
                           "end_s": [1.0, 3.0], "throughput_tok_s": [100.0, 90.0],
                           "ttft_median_s": 0.1, "decode_tok_s_median": 10.0, "rss_bytes": 1e9,
                           "kv_bytes": 1e6, "errors": 0, "kills": 0, "recoveries": 0,
                           "lost_requests": 0})
    requests = pd.DataFrame([{"round": 0, "arm": a, "id": f"p{i}", "line": i + 1,
                              "completion_tokens": [1, 2 + (a == "B")], "finish_reason": "length",
                              "ttft_s": 0.1, "decode_tokens_per_s": 10.0,
                              "temperature": 0.7 if i else 0.0} for a in "AB" for i in range(3)])
    out = tmp_path / "report.html"
    write_report(out, summarize(requests, rounds), rounds, parity_table(requests),
                 pd.DataFrame(columns=["time_s"]), "t")
    page = out.read_text()
    assert "<p>1 prompt-rounds compared, 1 differ;" in page
    assert "2 prompt-rounds sampled (temperature &gt; 0 in A or B" in page
    assert "are not compared, token by token or otherwise" in page


def _runner_rounds(tmp_path, runs):
    """rounds.parquet's rows as the soak runner makes them (runner._round_rows over each run's
    result Parquet and --stats JSON): runs maps (round, arm) to (stats or None, rows)."""
    from cluster.soak import runner
    rows = []
    for (rnd, arm), (stats, served) in runs.items():
        out, st = tmp_path / f"r{rnd:03d}_{arm}.parquet", tmp_path / f"r{rnd:03d}_{arm}.stats.json"
        pd.DataFrame([{"id": "p0", "line": 1, "finish_reason": "length", "error": None, **r}
                      for r in served]).to_parquet(out)
        if stats is not None:
            st.write_text(json.dumps(stats))
        t = 100.0 + 10 * rnd + 5 * (arm == "B")
        rows.append(runner._round_rows({"round": rnd, "arm": arm, "label": arm, "start_s": t,
                                        "end_s": t + 3.0, "returncode": "0", "parquet": out,
                                        "stats": st}, {"p0"})[0])
    return pd.DataFrame(rows)


def test_report_leaves_out_ratios_that_are_not_finite_and_says_how_many(tmp_path):
    """A round pair whose A value is 0 (a run that generated no token: throughput 0, or a TTFT
    of 0) has an infinite B/A ratio, one with a value missing (no --stats: no throughput) a
    NaN one. The summary leaves those out; the report's histogram took the infinite ones and
    crashed (numpy: "supplied range of [1.0, inf] is not finite"). Now it leaves them out too,
    and says how many, per metric."""
    ok = {"tokens": 480, "wall_s": 4.0, "decode_tokens": 400, "decode_steps": 40}
    row = {"ttft_s": 0.31, "decode_tokens_per_s": 17.5}
    runs = {(0, "A"): ({**ok, "tokens": 0}, [{**row, "ttft_s": 0.0}]),  # A's 0: inf ratios
            (0, "B"): (ok, [row]),
            (1, "A"): (None, [row]),  # no --stats: throughput missing, a NaN ratio
            (1, "B"): (ok, [row]),
            (2, "A"): (ok, [{**row, "ttft_s": 0.0, "decode_tokens_per_s": 0.0}]),  # 0/0: NaN
            (2, "B"): (ok, [{**row, "ttft_s": 0.0, "decode_tokens_per_s": 0.0}]),
            (3, "A"): ({**ok, "tokens": 400}, [{**row, "ttft_s": 0.25}]),
            (3, "B"): (ok, [row])}
    rounds = _runner_rounds(tmp_path, runs)
    assert rounds.throughput_tok_s.iloc[0] == 0.0 and np.isnan(rounds.throughput_tok_s.iloc[2])
    requests = pd.DataFrame([{"round": r, "arm": a, "id": "p0", "line": 1,
                              "completion_tokens": [3, 4], "finish_reason": "length",
                              "ttft_s": 0.3, "decode_tokens_per_s": 17.0, "temperature": 0.0}
                             for r in range(4) for a in "AB"])
    s = summarize(requests, rounds)
    assert s["ratio_B_over_A"]["throughput_tok_s"]["n"] == 2  # rounds 0 and 1 left out
    assert s["ratio_B_over_A"]["ttft_median_s"]["n"] == 2  # rounds 0 and 2
    assert s["ratio_B_over_A"]["decode_tok_s_median"]["n"] == 3  # round 2
    out = tmp_path / "report.html"
    write_report(out, s, rounds, parity_table(requests), pd.DataFrame(columns=["time_s"]), "t")
    page = out.read_text()
    assert page.count("<img") == 4
    assert ("B/A ratios left out of the 4 round pairs (not finite: A's value 0, or a value "
            "missing; the summary leaves them out too): throughput_tok_s 2, ttft_median_s 2, "
            "decode_tok_s_median 1</p>") in page


def test_report_ratio_plot_of_a_metric_with_no_finite_ratio_says_so(tmp_path):
    """Every pair's A throughput 0: no ratio is left to draw for it; the panel says so (and
    the other metrics' panels are drawn) instead of an empty or broken histogram."""
    from cluster.soak import report
    ok = {"tokens": 480, "wall_s": 4.0}
    row = {"ttft_s": 0.31, "decode_tokens_per_s": 17.5}
    rounds = _runner_rounds(tmp_path, {(r, a): ({**ok, "tokens": 0} if a == "A" else ok, [row])
                                       for r in range(3) for a in "AB"})
    drawn = []
    real = report.plt.Axes.hist

    def hist(self, x, *a, **kw):
        drawn.append(np.asarray(x, float))
        return real(self, x, *a, **kw)
    report.plt.Axes.hist = hist
    try:
        b64, left_out = report._ratios(rounds, ["throughput_tok_s", "ttft_median_s"])
    finally:
        report.plt.Axes.hist = real
    assert b64 and left_out == {"throughput_tok_s": (3, 3), "ttft_median_s": (0, 3)}
    assert len(drawn) == 1 and np.isfinite(drawn[0]).all() and len(drawn[0]) == 3
