"""A soak arm's config: a job config YAML (cluster/config.py) with an optional `soak:`
section that only the soak reads.

The job part is checked by the code that will run it: an arm with a `working_dir` (another
checkout, e.g. a newer build under test) has its job config validated by that checkout's
own cluster/config.py, in a subprocess run there as its rounds are, so a setting only the
newer build knows is accepted and one that it refuses is refused before any round runs; its
job temperature (parity decides greedy lines by it) is that build's too. Where that checkout
cannot say (it does not import, or its code has no load_job_config), the soak warns and
validates with this checkout's schema instead; summary.json's `config_check` records which
code checked each arm.

The job settings that the soak's environment would give every round (KV8, KV_TQ,
KVFLEET_SLOTS, ...) are withheld from an arm's rounds and its config check, so each arm runs
its config as written: this checkout's job variables (cluster/config.py JOB_ENV) and those
that the arm's own checkout declares, which the same check reports (a newer build may read a
variable that this checkout does not know; an older one, one that this checkout dropped).
Where that checkout cannot say, the soak warns and withholds this checkout's alone;
summary.json's `job_env` records where each arm's list came from.

    kv: kv8                    # ... any JobConfig field
    soak:
      label: kv8               # name in the report (default: the file's stem)
      working_dir: ../other    # another checkout of kvfleet to run this arm from
      gate:                    # regression thresholds; the baseline's (--config) gate applies
        min_throughput_ratio: 0.95   # B/A median throughput below this fails
        max_parity_breaks: 0         # greedy lines whose A and B completions differ (a line
                                     # with temperature > 0 in either arm is not compared)
        max_lost_requests: 0         # requests with no result (e.g. after a worker kill)
        max_errors: null             # error rows per round
        max_failed_rounds: 0         # rounds whose generate run exited non-zero or timed out,
                                     # or left rows that failed at run time

    null turns a rule off. An enabled rule with nothing to check fails (missing data never
    passes: no measured throughput ratio, no greedy prompt-round compared, parity not
    evaluated because no prompt-round was served by both arms, a count not recorded
    or NaN).
    Whatever the rules say, an arm with no request finished with stop or length in any round
    fails the gate (e.g. every prompt line invalid): a soak that served nothing tested nothing.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cluster.cli import UsageError
from cluster.config import JOB_ENV, REPO_ROOT, validate_job_config
from cluster.yaml_config import DuplicateKeyError, load_yaml

log = logging.getLogger(__name__)


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SoakGate(_Frozen):
    min_throughput_ratio: float | None = Field(0.95, gt=0)
    max_parity_breaks: int | None = Field(0, ge=0)
    max_lost_requests: int | None = Field(0, ge=0)
    max_errors: int | None = Field(None, ge=0)
    max_failed_rounds: int | None = Field(0, ge=0)


class SoakSection(_Frozen):
    label: str | None = None
    working_dir: Path | None = None
    gate: SoakGate = SoakGate()


class SoakArm:
    """One side of an A/B soak: where its job config lies, how to run it, its gate."""

    def __init__(self, path: Path, job: dict, section: SoakSection, temperature: float,
                 key: str = "A", checked_by: str = "this checkout",
                 job_env: frozenset[str] = JOB_ENV, job_env_from: str = "this checkout"):
        self.path, self.job, self.section, self.key = path, job, section, key
        self.temperature = temperature  # the job's; a prompt line may set its own
        self.label = section.label or path.stem
        self.working_dir = _working_dir(path, section)
        self.checked_by = checked_by  # which code validated the job part (summary.json)
        self.job_env = job_env  # the variables withheld from its rounds (checkout_env)
        self.job_env_from = job_env_from  # which code declared them (summary.json)

    def write_job_config(self, where: Path) -> Path:
        """The job part alone, for `kvfleet generate --config` (which forbids `soak:`)."""
        where.write_text(yaml.safe_dump(self.job, sort_keys=False))
        return where


FLAGS = {"A": "--config", "B": "--vs"}  # the `kvfleet soak` flag that gives each arm


def _working_dir(path: Path, section: SoakSection) -> Path | None:
    """soak.working_dir, absolute: `~` expanded, a relative one against the arm file's folder."""
    wd = section.working_dir
    if wd is None:
        return None
    wd = wd.expanduser()
    return (wd if wd.is_absolute() else path.parent / wd).resolve()


def checkout_env(wd: Path, withheld: frozenset[str],
                 extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a process run in checkout `wd` for an arm (its rounds, its config
    check): this one's without the job settings `withheld` (the arm's job_env), plus
    `extra`, importing that checkout's code."""
    env = {k: v for k, v in os.environ.items() if k not in withheld}
    env.update(extra or {})
    env.update(PYTHONPATH=str(wd), RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE", "disabled"))
    return env


# run in the arm's checkout: its own load_job_config on the job part (as its rounds' generate
# --config reads it); prints one JSON line: the job temperature, or the refusal's message,
# the file the code came from (which must be that checkout's), and the variables its code
# sets job fields from, where it declares them (its cluster/config.py JOB_ENV; an older
# build's ENV_FIELDS, whose tier variables KV8 / KV_TQ / KV_TQ_POLAR JOB_ENV holds here)
_CHECK = """\
import json, sys
import cluster.config
from cluster.cli import UsageError
from cluster.config import load_job_config
got = {"source": cluster.config.__file__}
names = getattr(cluster.config, "JOB_ENV", getattr(cluster.config, "ENV_FIELDS", None))
if isinstance(names, (dict, set, frozenset, list, tuple)):
    got["job_env"] = sorted(str(v) for v in names)
try:
    got["temperature"] = float(load_job_config(sys.argv[1]).sampling.temperature)
except UsageError as e:
    got["error"] = str(e)
print(json.dumps(got))
"""
CHECK_TIMEOUT_S = 120.0


def _run_check(job_file: Path, wd: Path, withheld: frozenset[str]) -> tuple[dict | None, str]:
    """One run of _CHECK in checkout wd on job_file, in an arm's environment withholding
    `withheld`: (its JSON, "") or (None, why it said nothing usable)."""
    try:
        p = subprocess.run([sys.executable, "-c", _CHECK, str(job_file)], cwd=wd,
                           env=checkout_env(wd, withheld), capture_output=True, text=True,
                           timeout=CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"its check ran past {CHECK_TIMEOUT_S:.0f}s"
    except OSError as e:
        return None, e.strerror
    lines = p.stdout.strip().splitlines()
    try:
        got = json.loads(lines[-1]) if p.returncode == 0 and lines else None
    except json.JSONDecodeError:
        got = None
    if not isinstance(got, dict) or not ({"error", "temperature"} & set(got)):
        return None, (p.stderr.strip().splitlines() or [f"exit status {p.returncode}"])[-1]
    source = Path(str(got.get("source"))).resolve()
    if not source.is_relative_to(wd):  # (e.g. a checkout with no cluster/__init__.py)
        return None, f"its python imported {source}, not that checkout's cluster/config.py"
    return got, ""


def _check_in_checkout(job: dict, path: Path, wd: Path) -> tuple[dict | None, str]:
    """The arm's job part validated by checkout wd's own code: ({"temperature": t} or
    {"error": message}, with "job_env": the variables that code sets job fields from, where
    it declares them, ""), or (None, why it could not be checked there). The check runs in
    the environment that the arm's rounds get: without JOB_ENV, nor the variables it
    declares."""
    with tempfile.TemporaryDirectory(prefix="kvfleet-soak-check-") as tmp:
        job_file = Path(tmp) / path.name
        job_file.write_text(yaml.safe_dump(job, sort_keys=False))
        got, why = _run_check(job_file, wd, JOB_ENV)
        own = frozenset(got.get("job_env", ())) if got else frozenset()
        if (own - JOB_ENV) & set(os.environ):
            # its code read job settings that only it knows from this environment, which
            # its rounds will not get: its list is known now, check again without them
            got, why = _run_check(job_file, wd, JOB_ENV | own)
        if got is not None and "error" in got:  # (its messages name the temporary copy)
            got["error"] = str(got["error"]).replace(str(job_file), str(path))
        return got, why


def load_arm(path: str | Path, key: str = "A") -> SoakArm:
    path = Path(path)
    try:
        data = load_yaml(path.read_text()) or {}
    except OSError as e:
        raise UsageError(f"{FLAGS.get(key, 'arm ' + key)} {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except DuplicateKeyError as e:  # (PyYAML keeps the last: the arm would run another config)
        raise UsageError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        raise UsageError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: must be a mapping of config fields")
    raw = data.pop("soak", None) or {}
    try:
        section = SoakSection.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise UsageError(f"{path}: soak.{where}: {err['msg']}") from None
    flag = FLAGS.get(key, "arm " + key)
    wd = _working_dir(path, section)
    if wd is not None and not (wd / "cluster" / "__main__.py").exists():
        raise UsageError(f"{path}: soak.working_dir {wd} is not a kvfleet checkout "
                         f"({'no such directory' if not wd.is_dir() else 'no cluster/__main__.py'})")
    if wd is None or wd == REPO_ROOT:
        cfg = validate_job_config(data, str(path))  # the job part must stand on its own
        return SoakArm(path, data, section, temperature=cfg.sampling.temperature, key=key)
    got, why = _check_in_checkout(data, path, wd)  # the job part, as the arm's own code reads it
    if got is not None and "error" in got:
        raise UsageError(f"{flag}: the job config is refused by soak.working_dir {wd}'s own "
                         f"code: {got['error']}")
    if got is None:
        log.warning("%s %s: cannot validate its job config with soak.working_dir %s's own code "
                    "(%s); validating it with this checkout's (%s) instead, which may refuse a "
                    "setting only that build knows or accept one it refuses", flag, path, wd,
                    why, REPO_ROOT)
        temperature = validate_job_config(data, str(path)).sampling.temperature
        checked_by = f"this checkout {REPO_ROOT} (its own checkout {wd} could not: {why})"
    else:
        temperature, checked_by = got["temperature"], f"its own checkout {wd}"
    job_env, job_env_from = _arm_job_env(got, why, flag, path, wd)
    return SoakArm(path, data, section, temperature=temperature, key=key, checked_by=checked_by,
                   job_env=job_env, job_env_from=job_env_from)


def _arm_job_env(got: dict | None, why: str, flag: str, path: Path,
                 wd: Path) -> tuple[frozenset[str], str]:
    """The variables withheld from the rounds of an arm run from checkout wd (JOB_ENV and
    those its check reported) and which code declared them; where its check reported none,
    JOB_ENV alone, with a warning."""
    if got is not None and "job_env" in got:
        return JOB_ENV | frozenset(got["job_env"]), f"its own checkout {wd}"
    if got is not None:
        why = "its cluster/config.py declares neither JOB_ENV nor ENV_FIELDS"
    log.warning("%s %s: soak.working_dir %s's code cannot say which environment variables it "
                "reads job settings from (%s); withholding this checkout's (%s) from that "
                "arm's rounds instead: one that only that build reads, if set, still reaches "
                "them", flag, path, wd, why, REPO_ROOT)
    return JOB_ENV, f"this checkout {REPO_ROOT} (its own checkout {wd} could not: {why})"
