"""The soak report renders in a real headless browser: no errors, every plot decoded."""
import json
import re
import subprocess
from html.parser import HTMLParser

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


class _ArmsTable(HTMLParser):
    """The rows of the page's arms table (<table class="arms">) past its header, each as
    (the row's class, [(cell class, cell text), ...]), the arm's <th> first."""

    def __init__(self, page):
        super().__init__()
        self.rows, self.depth, self.cell = [], 0, None
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        cls = dict(attrs).get("class") or ""
        if tag == "table":
            self.depth += 1 if (self.depth or cls == "arms") else 0
        elif self.depth and tag == "tr":
            self.rows.append((cls, []))
        elif self.depth and tag in ("th", "td"):
            self.cell = [cls, ""]
        elif self.depth and self.cell is not None:
            raise AssertionError(f"markup <{tag}> inside an arms table cell")

    def handle_endtag(self, tag):
        if self.depth and tag == "table":
            self.depth -= 1
        elif self.depth and tag in ("th", "td"):
            self.rows[-1][1].append(tuple(self.cell))
            self.cell = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell[1] += data


def _arm_rows(page):
    rows = _ArmsTable(page).rows
    assert rows and [c for _, c in rows[0][1]] == [
        "arm", "label", "build", "job config check", "job variables declared by",
        "withheld from its rounds"]
    return rows[1:]


def _two_arm_report(tmp_path, arms=("A", "B"), **extra):
    """write_report on the summary of one round of each arm, with `extra` keys added."""
    rounds = pd.DataFrame({"round": [0, 0], "arm": list(arms), "start_s": [0.0, 2.0],
                           "end_s": [1.0, 3.0], "throughput_tok_s": [100.0, 90.0],
                           "ttft_median_s": 0.1, "decode_tok_s_median": 10.0, "rss_bytes": 1e9,
                           "kv_bytes": 1e6, "errors": 0, "kills": 0, "recoveries": 0,
                           "lost_requests": 0})
    requests = pd.DataFrame([{"round": 0, "arm": a, "id": "p0", "line": 1,
                              "completion_tokens": [1, 2], "finish_reason": "length",
                              "ttft_s": 0.1, "decode_tokens_per_s": 10.0, "temperature": 0.0}
                             for a in arms])
    s = {**summarize(requests, rounds), **extra}
    out = tmp_path / "report.html"
    write_report(out, s, rounds, parity_table(requests), pd.DataFrame(columns=["time_s"]), "t")
    return out.read_text(), s


def test_report_arms_table_from_a_real_soak_escapes_and_marks_the_fallback(
        tmp_path, monkeypatch):
    """The per-arm config checks and job variables were only in the raw summary.json dump.
    A real soak (no Ray: its rounds are a fake generate) of arm A, whose checkout has no
    config code (so its config is checked here and its job-variable list is this
    checkout's: the fallback), and arm B, whose checkout declares its own list, from paths
    and labels full of HTML: each arm's row says what summary.json says, escaped, and A's
    row and cells are marked as a warning, B's not."""
    import yaml
    from test_soak_runner import ENV_RECORDING_GENERATE, _no_ray, _prompts
    from cluster.config import JOB_ENV
    from cluster.soak import runner
    from cluster.soak.config import load_arm
    _no_ray(monkeypatch)
    old, new = tmp_path / 'old <i>"x"&amp;', tmp_path / "new </td><b>"
    for wd in (old, new):
        (wd / "cluster").mkdir(parents=True)
        (wd / "cluster" / "__main__.py").write_text(ENV_RECORDING_GENERATE)
    (new / "cluster" / "__init__.py").write_text("")
    (new / "cluster" / "cli.py").write_text("class UsageError(Exception):\n    pass\n")
    (new / "cluster" / "config.py").write_text(
        "import types\nJOB_ENV = ('KV8', 'NEW_<KNOB>&')\n"
        "def load_job_config(path):\n"
        "    return types.SimpleNamespace(sampling=types.SimpleNamespace(temperature=0.0))\n")
    # B's checkout is a git repository, committed (A's is none): its build is recorded
    (new / "pyproject.toml").write_text('[project]\nname = "kvfleet"\nversion = "9.<i>"\n')
    git = ["git", "-C", str(new), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "b"]):
        subprocess.run(git + args, check=True)
    head = subprocess.run(git + ["rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    labels = {"A": '<script>alert("a")</script>', "B": "kv8 & <b>bold</b>"}
    paths = {}
    for key, wd in (("A", old), ("B", new)):
        paths[key] = tmp_path / f"{key}.yaml"
        paths[key].write_text(yaml.safe_dump({"kv": "kv8", "soak": {
            "label": labels[key], "working_dir": str(wd)}}))
    monkeypatch.setenv("KV8", "1")
    monkeypatch.setenv("NEW_<KNOB>&", "2")
    out = tmp_path / "soak"
    runner.run_soak(runner.SoakPlan(arms=[load_arm(paths["A"], "A"), load_arm(paths["B"], "B")],
                                    prompts=_prompts(tmp_path), out=out, rounds=1))
    written = json.loads((out / "summary.json").read_text())
    page = (out / "report.html").read_text()
    assert "<script>alert" not in page and "<i>" not in page and "</td><b>" not in page
    (ca, a), (cb, b) = _arm_rows(page)
    check_a, env_a = written["config_check"]["A"], written["job_env"]["A"]
    assert "could not" in check_a and "could not" in env_a["from"]  # (the fallback, both)
    n = len(JOB_ENV)
    build_a = written["build"]["A"]
    assert build_a["commit"] is None and build_a["dirty"] is None
    assert "not a git repository" in build_a["git_error"]
    assert written["build"]["B"] == {"checkout": str(new), "commit": head, "dirty": False,
                                     "changed_files": 0, "git_error": None, "version": "9.<i>",
                                     "version_error": None}
    assert ca == "warn" and a == [
        ("", "A"), ("", labels["A"]),
        ("unknown", f"{old}: no git commit ({build_a['git_error']})"),
        ("warn", f"warning: passed, but checked by {check_a} instead, whose schema may accept "
                 "a setting that build refuses"),
        ("warn", f"warning: {env_a['from']}: {n} job variables, this checkout's; one that only "
                 "that build reads, if set here, still reaches its rounds"),
        ("", f"KV8 (1 of its {n} job variables, set here)")]
    assert written["config_check"]["B"] == f"its own checkout {new}"
    assert written["job_env"]["B"]["withheld"] == ["KV8", "NEW_<KNOB>&"]
    n = len(written["job_env"]["B"]["variables"])
    assert cb == "" and b == [
        ("", "B"), ("", labels["B"]), ("", f"{new}, kvfleet 9.<i>, git {head}, clean"),
        ("pass", f"passed, checked by its own checkout {new}"),
        ("", f"its own checkout {new} ({n} job variables)"),
        ("", f"KV8, NEW_<KNOB>& (2 of its {n} job variables, set here)")]
    assert page.index("<h2>arms</h2>") < page.index("<img")  # near the top, after the gate
    assert page.index("gate: ") < page.index("<h2>arms</h2>")


def test_report_arms_of_an_older_summary_say_not_recorded(tmp_path):
    """A summary from a soak that recorded no labels, config_check or job_env renders, each
    arm's row saying "not recorded" (not a check passed, nor nothing withheld)."""
    page, _ = _two_arm_report(tmp_path)
    assert _arm_rows(page) == [
        ("", [("", arm), ("", "not recorded")] + [("unknown", "not recorded")] * 4)
        for arm in "AB"]
    page, _ = _two_arm_report(tmp_path, labels={"A": "f32"}, config_check={"A": "this checkout"})
    assert _arm_rows(page) == [
        ("", [("", "A"), ("", "f32"), ("unknown", "not recorded"),
              ("pass", "passed, checked by this checkout")] + [("unknown", "not recorded")] * 2),
        ("", [("", "B"), ("", "not recorded")] + [("unknown", "not recorded")] * 4)]


def test_report_arms_with_hostile_names_and_empty_or_unreadable_records(tmp_path):
    """Arm names full of HTML, an empty withheld list, and records in no form the soak
    writes (a config_check that is no text, a job_env "from" that names no checkout, a
    withheld that is no list), which are marked as warnings, never shown as normal."""
    arms = ('<img src=x onerror="alert(1)">', "A&amp;B")
    dirty = {"checkout": "/x/<y>", "commit": "ab" * 20, "dirty": True, "changed_files": 1,
             "version": None}
    page, _ = _two_arm_report(
        tmp_path, arms=arms, labels={arms[0]: "</table>"},
        build={arms[0]: dirty, arms[1]: ["/x"]},
        config_check={arms[0]: "its own checkout /x/<y>", arms[1]: {"ok": True}},
        job_env={arms[0]: {"from": "its own checkout /x/<y>", "variables": ["KV8", "KV_TQ"],
                           "withheld": []},
                 arms[1]: {"from": "elsewhere", "variables": [], "withheld": "KV8"}})
    assert "<img src=x" not in page
    rows = sorted(_arm_rows(page), key=lambda r: r[1][0][1])
    assert rows == sorted([
        ("warn", [("", arms[0]), ("", "</table>"),
                  ("warn", f"warning: /x/<y>, git {'ab' * 20}, dirty (1 changed file: the "
                           "commit is not all that ran)"),
              ("pass", "passed, checked by its own checkout /x/<y>"),
              ("", "its own checkout /x/<y> (2 job variables)"),
              ("", "none (none of its 2 job variables is set here)")]),
        ("warn", [("", arms[1]), ("", "not recorded"),
                  ("warn", 'warning: unreadable record: ["/x"]'),
                  ("warn", 'warning: unreadable record: {"ok": true}')]
         + [("warn", 'warning: unreadable record: {"from": "elsewhere", "variables": [], '
                     '"withheld": "KV8"}')] * 2)], key=lambda r: r[1][0][1])
    # a summary whose records are not per arm at all
    page, _ = _two_arm_report(tmp_path, config_check="its own checkout /x", job_env=["KV8"],
                              build="/x")
    assert _arm_rows(page) == [
        ("warn", [("", arm), ("", "not recorded"), ("warn", 'warning: unreadable record: "/x"'),
                  ("warn", 'warning: unreadable record: "its own checkout /x"')]
         + [("warn", 'warning: unreadable record: ["KV8"]')] * 2) for arm in "AB"]


def test_arm_lines_say_per_arm_what_was_withheld():
    """The console's per-arm lines (the arms table as text): the fallback is a warning."""
    from cluster.soak.report import arm_lines
    fallback = "this checkout /r (its own checkout /o could not: no module)"
    commit = "0123456789abcdef0123456789abcdef01234567"
    assert arm_lines({"arms": ["A", "B"], "labels": {"A": "f32", "B": "kv8"},
                      "build": {"A": {"checkout": "/n", "commit": commit, "dirty": False,
                                      "changed_files": 0, "version": "0.1.0"},
                                "B": {"checkout": "/o", "commit": None, "dirty": None,
                                      "git_error": "no git binary on PATH"}},
                      "config_check": {"A": "its own checkout /n", "B": fallback},
                      "job_env": {"A": {"from": "its own checkout /n", "variables": ["KV8"],
                                        "withheld": ["KV8"]},
                                  "B": {"from": fallback, "variables": ["KV8", "KV_TQ"],
                                        "withheld": []}}}) == [
        f"soak: arm A (f32): build /n, kvfleet 0.1.0, git {commit}, clean; "
        "job config passed, checked by its own checkout /n; job variables "
        "declared by its own checkout /n (1 job variable); withheld from its rounds: KV8 "
        "(1 of its 1 job variable, set here)",
        "soak: warning: arm B (kv8): build /o: no git commit (no git binary on PATH); "
        f"job config passed, but checked by {fallback} instead, "
        f"whose schema may accept a setting that build refuses; job variables declared by "
        f"{fallback}: 2 job variables, this checkout's; one that only that build reads, if "
        "set here, still reaches its rounds; withheld from its rounds: none (none of its 2 "
        "job variables is set here)"]
    assert arm_lines({"arms": ["A"], "metrics": {}}) == [
        "soak: arm A (not recorded): build not recorded; job config not recorded; job "
        "variables declared by not "
        "recorded; withheld from its rounds: not recorded"]


def test_an_interrupted_soaks_report_says_so_over_its_gate(tmp_path):
    """A soak stopped by SIGTERM / Ctrl-C wrote its report for the finished rounds with
    'gate: PASS' and nothing on the page saying the soak was cut short (only summary.json
    had `interrupted`)."""
    cut = {"signal": "SIGTERM", "rounds_kept": 1, "cut_round": 1, "cut_arm": "<B>"}
    page, _ = _two_arm_report(tmp_path, interrupted=cut)
    warn = page.index('<p class="warn"><b>warning: interrupted by SIGTERM after 1 finished round(s); '
                      'round 1 (arm &lt;B&gt;) was cut')
    assert warn < page.index("gate: PASS") and "<B>" not in page
    page, _ = _two_arm_report(tmp_path)
    assert "interrupted by" not in page
