"""The soak's self-contained HTML report: plots rendered with matplotlib (Agg) and inlined
as base64 PNG, tables as plain HTML. No external scripts, styles or fonts."""
from __future__ import annotations

import base64
import html
import io
import json

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from cluster.soak.summary import completed, describe_failure, failed  # noqa: E402

COLORS = {"A": "#1f77b4", "B": "#d62728"}


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _over_time(rounds: pd.DataFrame, metrics: list[tuple[str, str]], title: str) -> str:
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.2 * len(metrics), 3.2))
    axes = [axes] if len(metrics) == 1 else axes
    t0 = rounds.start_s.min()
    bad = failed(rounds)
    for ax, (col, label) in zip(axes, metrics):
        for arm, r in completed(rounds).groupby("arm"):
            ax.plot(r.start_s - t0, r[col], "o-", color=COLORS.get(arm), label=f"{arm}")
        for arm, r in bad.groupby("arm"):  # partial figures: shown, not joined or summarized
            ax.plot(r.start_s - t0, r[col], "x", ms=9, mew=2, color=COLORS.get(arm),
                    label=f"{arm} failed round")
        ax.set_xlabel("time since start (s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    return _png(fig)


def _ratios(rounds: pd.DataFrame, metrics: list[str]) -> tuple[str, dict] | None:
    """The histogram of each metric's per-round B/A ratios, and per metric (ratios left out,
    round pairs): a pair whose ratio is not finite (A's value 0, or either value missing) is
    left out, as the summary's ratios leave it out (summary._stats)."""
    done = completed(rounds)  # pairs of completed rounds, as the summary's ratios
    a = done[done.arm == "A"].set_index("round")
    b = done[done.arm == "B"].set_index("round")
    common = a.index.intersection(b.index)
    if common.empty:
        return None
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3))
    left_out = {}
    for ax, m in zip(axes, metrics):
        with np.errstate(divide="ignore", invalid="ignore"):
            r = (pd.to_numeric(b.loc[common, m], errors="coerce")
                 / pd.to_numeric(a.loc[common, m], errors="coerce")).to_numpy(np.float64)
        r = r[np.isfinite(r)]
        left_out[m] = (len(common) - len(r), len(common))
        if len(r):
            ax.hist(r, bins=max(3, min(20, len(r))), color="#7f7f7f")
            ax.axvline(1.0, color="k", lw=1)
        else:
            ax.text(0.5, 0.5, "no finite ratio", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"{m} B/A" + (f" ({left_out[m][0]} of {len(common)} left out)"
                                   if left_out[m][0] else ""))
    fig.suptitle("per-round ratio distributions", y=1.04)
    return _png(fig), left_out


def _faults(rounds: pd.DataFrame, faults: pd.DataFrame) -> str:
    fig, ax = plt.subplots(figsize=(10, 2.4))
    t0 = rounds.start_s.min()
    for arm, r in rounds.groupby("arm"):
        ax.barh(arm, r.end_s - r.start_s, left=r.start_s - t0, color=COLORS.get(arm), alpha=0.5)
    bad = failed(rounds)
    if len(bad):  # outlined and hatched: the round failed (cluster/soak/runner.py)
        ax.barh(bad.arm, bad.end_s - bad.start_s, left=bad.start_s - t0, fill=False,
                edgecolor="#b00", hatch="xx", lw=1.5, label="failed round")
    # dotted: a kill after its round's job had taken its last step, dash-dot: of an idle
    # worker the job never stepped again (runner.classify_kills)
    late = (faults.after_end if "after_end" in faults
            else pd.Series(False, index=faults.index)).astype(bool)
    unseen = (faults.outcome == "unseen") if "outcome" in faults \
        else pd.Series(False, index=faults.index)
    for kills, color, style, label in (
            (faults[~late & ~unseen], "k", "dashed", "worker killed"),
            (faults[unseen], "#777", "dashdot", "idle worker killed (no death found)"),
            (faults[late], "#999", "dotted", "worker killed after its round's last step")):
        if len(kills):
            ax.vlines(kills.time_s - t0, -0.5, len(rounds.arm.unique()) - 0.5, colors=color,
                      linestyles=style, label=label)
    if not faults.empty or len(bad):
        ax.legend(loc="upper right")
    ax.set_xlabel("time since start (s)")
    ax.set_title("rounds and fault timeline")
    return _png(fig)


def _kills(summary: dict) -> str:
    f = summary.get("faults", {})
    if not f.get("kills") and not f.get("kills_after_end"):
        return ""
    kills, late = f.get("kills") or 0, f.get("kills_after_end") or 0
    unseen, unknown = f.get("kills_unseen") or 0, f.get("kills_unknown") or 0
    parts = [f"{kills - unseen - unknown} found dead by the job"]
    if unseen:
        parts.append(f"{unseen} of an idle worker (nothing in flight there, and the job gave it "
                     "nothing after: it never stepped it again, so it found no death and had "
                     "nothing to recover)")
    if unknown:
        parts.append(f"{unknown} in rounds whose run recorded no count of the deaths it found "
                     "(it crashed or timed out before writing its --stats)")
    return (f"<h2>worker kills</h2><p>{kills} worker kills while a round's job ran ("
            + "; ".join(parts) + f"), {f.get('recoveries', 0)} recoveries, "
            f"{f.get('lost_requests', 0)} lost requests"
            + (f"; {late} more killed after their round's job had taken its last "
               "step: nothing was left to run, so no recovery could follow, and they "
               "count as no kill of that round (dotted on the timeline)" if late else "")
            + ". Every kill is in faults.parquet with its outcome.</p>")


def _failed_rounds(summary: dict) -> str:
    failed = summary.get("failed_rounds")
    if failed is None:
        return ""
    if not failed:
        return ("<h2>failed rounds</h2><p>none: every round's run exited 0 with no row failed "
                "at run time</p>")
    rows = "".join(f"<tr><td>{f['round']}</td><td>{html.escape(f['arm'])}</td>"
                   f"<td>{html.escape(describe_failure(f))}</td>"
                   f"<td>rounds/r{f['round']:03d}_{html.escape(f['arm'])}.log</td></tr>"
                   for f in failed)
    return (f'<h2 class="fail">failed rounds: {len(failed)}</h2><p>the run of these rounds '
            "exited non-zero, timed out or left rows that failed at run time (a worker's step "
            "raised, no live worker was left); the rows they had served are kept (unserved ones "
            "count as lost, error rows as errors), and each counts against the gate's "
            "max_failed_rounds. Their throughput, latency, memory and wall-time figures are "
            "partial: the per-arm medians and the B/A ratios come from completed rounds only "
            "(a ratio from a pair of them), and the plots mark a failed round with an x.</p>"
            "<table><tr><th>round</th><th>arm</th><th>how</th><th>log</th></tr>"
            f"{rows}</table>")


COUNTER_NAMES = {"worker_deaths": "worker deaths", "recoveries": "recoveries",
                 "requeued": "sequences re-queued", "runtime_errors": "rows failed at run time"}


def _counters(summary: dict) -> str:
    """The scheduler counters per arm (summary.counters), one row each: those the summary
    has, then every fallback path and saved-KV event any arm counted."""
    arms = [a for a in summary.get("arms", []) if "counters" in summary["metrics"].get(a, {})]
    if not arms:
        return ""
    c = {a: summary["metrics"][a]["counters"] for a in arms}
    rows = [(label, [c[a].get(k) for a in arms]) for k, label in COUNTER_NAMES.items()
            if any(k in c[a] for a in arms)]
    for group, label in (("fallbacks", "fallback"), ("kv_cache", "KV cache")):
        keys = sorted({k for a in arms for k in c[a].get(group, {})})
        rows += [(f"{label}: {k}", [c[a].get(group, {}).get(k, 0) for a in arms]) for k in keys]
    labels = summary.get("labels", {})
    head = "".join(f"<th>{html.escape(f'{a} ({labels[a]})' if a in labels else a)}</th>"
                   for a in arms)
    body = "".join(f"<tr><th>{html.escape(name)}</th>"
                   + "".join(f"<td>{'' if v is None else v}</td>" for v in vals) + "</tr>"
                   for name, vals in rows)
    return ("<h2>scheduler counters</h2><p>summed over each arm's rounds, failed ones included "
            "(from each run's <code>generate --stats</code>)</p>"
            f"<table><tr><th></th>{head}</tr>{body}</table>")


# summary.json's config_check and job_env "from" (cluster/soak/config.py) say which code
# checked an arm's job config or declared its job variables: "this checkout" (an arm with
# no working_dir), "its own checkout WD", or, where that checkout could not say, the
# fallback "this checkout ROOT (its own checkout WD could not: WHY)"
def _source(value) -> str:
    """"missing" (an older soak's summary recorded none), "own" (the arm's own code),
    "fallback", or "unknown" (not a form the soak writes)."""
    if value is None:
        return "missing"
    if not isinstance(value, str):
        return "unknown"
    if value == "this checkout" or value.startswith("its own checkout "):
        return "own"
    fallback = value.startswith("this checkout ") and " could not: " in value
    return "fallback" if fallback else "unknown"


def _unreadable(value) -> tuple[str, str]:
    return "unreadable record: " + json.dumps(value, default=str), "warn"


def _check_cell(check) -> tuple[str, str]:
    """(text, class) of an arm's config_check. A config that its check refused stopped the
    soak before any round (cluster/soak/config.py load_arm), so every one recorded passed."""
    how = _source(check)
    if how == "missing":
        return "not recorded", "unknown"
    if how == "unknown":
        return _unreadable(check)
    if how == "own":
        return f"passed, checked by {check}", "pass"
    return (f"passed, but checked by {check} instead, whose schema may accept a setting that "
            "build refuses", "warn")


def _env_cells(env) -> list[tuple[str, str]]:
    """(text, class) of an arm's job_env: the code that declared its job variables, and
    those of them withheld from its rounds (set here)."""
    if env is None:
        return [("not recorded", "unknown")] * 2
    got = env if isinstance(env, dict) else {}
    declared, withheld, how = got.get("variables"), got.get("withheld"), _source(got.get("from"))
    names = all(isinstance(v, list) and all(isinstance(n, str) for n in v)
                for v in (declared, withheld))
    if how in ("missing", "unknown") or not names:
        return [_unreadable(env)] * 2
    of = f"{len(declared)} job variable{'' if len(declared) == 1 else 's'}"
    source = ((f"{got['from']} ({of})", "") if how == "own" else
              (f"{got['from']}: {of}, this checkout's; one that only that build reads, if set "
               "here, still reaches its rounds", "warn"))
    return [source, (", ".join(withheld) + f" ({len(withheld)} of its {of}, set here)", "")
            if withheld else (f"none (none of its {of} is set here)", "")]


def _build_cell(info) -> tuple[str, str]:
    """(text, class) of an arm's build record (cluster/soak/build.py): class "warn" for a
    dirty tree (its commit is not all that ran), "unknown" where no commit is recorded."""
    if info is None:
        return "not recorded", "unknown"
    if not isinstance(info, dict) or not isinstance(info.get("checkout"), str):
        return _unreadable(info)
    version = info.get("version")
    where = info["checkout"] + (f", kvfleet {version}" if isinstance(version, str) else "")
    commit = info.get("commit")
    if not isinstance(commit, str):
        why = info.get("git_error")
        return (f"{where}: no git commit ({why if isinstance(why, str) else 'no reason given'})",
                "unknown")
    if not info.get("dirty"):
        return f"{where}, git {commit}, clean", ""
    n = info.get("changed_files")
    files = f"{n} changed file{'' if n == 1 else 's'}" if isinstance(n, int) else "changed files"
    return f"{where}, git {commit}, dirty ({files}: the commit is not all that ran)", "warn"


def _arm_cells(summary: dict, arm: str) -> list[tuple[str, str]]:
    """(text, class) of an arm's build, config check, the code that declared its job
    variables, and those withheld from its rounds. Class "warn": a dirty tree, a fallback,
    or a record in no form the soak writes; "unknown": not recorded (a summary from before
    the soak recorded it) or no git commit."""
    build, check, env = (summary.get(k) for k in ("build", "config_check", "job_env"))
    # (each a mapping arm -> record; one that is not is in no form the soak writes)
    cells = [_build_cell((build or {}).get(arm)) if build is None or isinstance(build, dict)
             else _unreadable(build),
             _check_cell((check or {}).get(arm)) if check is None or isinstance(check, dict)
             else _unreadable(check)]
    if env is not None and not isinstance(env, dict):
        return cells + [_unreadable(env)] * 2
    return cells + _env_cells((env or {}).get(arm))


def _arm_rows(summary: dict) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """(arm, label, cells) per arm the summary names: its `arms`, then any that only its
    labels, build, config_check or job_env name."""
    keys = list(summary.get("arms") or [])
    for table in ("labels", "build", "config_check", "job_env"):
        if isinstance(summary.get(table), dict):
            keys += [k for k in summary[table] if k not in keys]
    labels = summary.get("labels") if isinstance(summary.get("labels"), dict) else {}
    return [(str(a), "not recorded" if labels.get(a) is None else str(labels[a]),
             _arm_cells(summary, a)) for a in keys]


def _arms(summary: dict) -> str:
    """The arms table (summary.json labels, build, config_check, job_env), a row with a
    dirty tree or a fallback marked."""
    rows = []
    for arm, label, cells in _arm_rows(summary):
        warn = any(c == "warn" for _, c in cells)
        rows.append(('<tr class="warn">' if warn else "<tr>")
                    + f"<th>{html.escape(arm)}</th><td>{html.escape(label)}</td>"
                    + "".join((f'<td class="{c}">' if c else "<td>")
                              + ("warning: " if c == "warn" else "") + f"{html.escape(t)}</td>"
                              for t, c in cells) + "</tr>")
    if not rows:
        return ""
    return ("<h2>arms</h2><p>each arm's build is its checkout's git commit and tree state "
            "when the soak started; its job config is checked before any round runs, by its "
            "own checkout's code where that can (a refused config stops the soak), and the "
            "job variables that code reads (KV8, KV_TQ, KVFLEET_SLOTS, ...) are withheld from "
            "its rounds where they are set here, so each arm runs its config as written</p>"
            '<table class="arms"><tr><th>arm</th><th>label</th><th>build</th>'
            "<th>job config check</th>"
            "<th>job variables declared by</th><th>withheld from its rounds</th></tr>"
            + "".join(rows) + "</table>")


def arm_lines(summary: dict) -> list[str]:
    """The arms table as one line of text per arm, for the console."""
    return [f"soak: {'warning: ' if any(c == 'warn' for _, c in cells) else ''}arm {arm} "
            f"({label}): build {cells[0][0]}; job config {cells[1][0]}; job variables "
            f"declared by {cells[2][0]}; withheld from its rounds: {cells[3][0]}"
            for arm, label, cells in _arm_rows(summary)]


def _interrupted(summary: dict) -> str:
    """A banner over a soak stopped by a signal (summary.json `interrupted`): its gate and
    figures cover only the rounds that finished."""
    cut = summary.get("interrupted")
    if not cut:
        return ""
    what = (f"interrupted by {cut.get('signal', 'a signal')} after {cut.get('rounds_kept', '?')} "
            f"finished round(s); round {cut.get('cut_round', '?')} (arm {cut.get('cut_arm', '?')}) "
            f"was cut and is left out: the gate and every figure below cover the finished rounds only")
    return f'<p class="warn"><b>warning: {html.escape(str(what))}</b></p>'


def _img(b64: str | None, alt: str) -> str:
    return "" if b64 is None else f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{b64}">'


def _ratio_plot(rounds: pd.DataFrame) -> str:
    if "B" not in set(rounds.arm):
        return ""
    drawn = _ratios(rounds, ["throughput_tok_s", "ttft_median_s", "decode_tok_s_median"])
    if drawn is None:
        return "<p>no B/A ratios: no round had both its A and its B run completed</p>"
    b64, left_out = drawn
    out = {m: n for m, (n, _) in left_out.items() if n}
    pairs = next(iter(left_out.values()))[1]
    note = (f"<p>B/A ratios left out of the {pairs} round pairs (not finite: A's value 0, or "
            "a value missing; the summary leaves them out too): "
            + ", ".join(f"{m} {n}" for m, n in out.items()) + "</p>") if out else ""
    return _img(b64, "ratio distributions") + note


def write_report(path, summary: dict, rounds: pd.DataFrame, parity: pd.DataFrame,
                 faults: pd.DataFrame, title: str) -> None:
    parts = [
        _img(_over_time(rounds, [("throughput_tok_s", "tokens/s"), ("ttft_median_s", "median TTFT (s)"),
                                 ("decode_tok_s_median", "decode tokens/s")],
                        "throughput and latency per round"), "throughput and latency over time"),
        _img(_over_time(rounds, [("rss_bytes", "process RSS (bytes)"),
                                 ("kv_bytes", "KV bytes in use")], "memory per round"),
             "memory over time"),
        _ratio_plot(rounds),
        _img(_faults(rounds, faults), "fault timeline"),
    ]
    gate = summary.get("gate", {})
    verdict = ("PASS" if gate.get("passed", True) else "FAIL: " + "; ".join(gate.get("failures", [])))
    breaks = parity[parity.first_diff.notna()] if not parity.empty else parity
    compared = int(parity.compared.sum()) if "compared" in parity else len(parity)  # (error pairs are not)
    sampled = int(parity.sampled.sum()) if "sampled" in parity else 0
    sampled_note = (f" {sampled} prompt-rounds sampled (temperature &gt; 0 in A or B, the line's "
                    "own or its arm's) are not compared, token by token or otherwise: they count "
                    "only in the lost requests, errors and timings." if sampled else "")
    if len(breaks):  # one row per prompt, one column per round: the first differing token
        table = (breaks.assign(first_diff=breaks.first_diff.astype(int))
                 .pivot(index="id", columns="round", values="first_diff")
                 .rename(columns=lambda r: f"round {r}"))
        table = table.astype("Int64").astype(str).replace("<NA>", "same")
    body = f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1200px}} img{{max-width:100%;display:block;margin:1em 0}}
table{{border-collapse:collapse}} td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}
.fail{{color:#b00}} .pass{{color:#070}} .warn{{color:#a50;background:#fff3dc}} .unknown{{color:#777}}
.arms td{{text-align:left}}</style></head><body>
<h1>{html.escape(title)}</h1>
{_interrupted(summary)}
<p class="{'pass' if gate.get('passed', True) else 'fail'}"><b>gate: {html.escape(verdict)}</b></p>
{_arms(summary)}
{_failed_rounds(summary)}
{_kills(summary)}
{''.join(parts)}
{_counters(summary)}
<h2>greedy parity (A vs B)</h2>
<p>{compared} prompt-rounds compared, {len(breaks)} differ; the table gives the index of the
first completion token where B differs from A (greedy decoding), "same" where it does not.{sampled_note}</p>
{table.to_html() if len(breaks) else '<p>no differing completions</p>'}
<h2>summary</h2><pre>{html.escape(json.dumps(summary, indent=1))}</pre>
<script>
// marks how many plots decoded, so a headless browser check can read it from the DOM
window.addEventListener("load", function () {{
  var ok = Array.prototype.filter.call(document.images, function (i) {{ return i.naturalWidth > 0; }});
  document.body.setAttribute("data-plots-loaded", String(ok.length));
}});
</script>
</body></html>"""
    with open(path, "w") as f:
        f.write(body)
