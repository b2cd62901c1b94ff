"""A soak arm's config: a job config YAML (cluster/config.py) with an optional `soak:`
section that only the soak reads.

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

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cluster.cli import UsageError
from cluster.config import validate_job_config


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
                 key: str = "A"):
        self.path, self.job, self.section, self.key = path, job, section, key
        self.temperature = temperature  # the job's; a prompt line may set its own
        self.label = section.label or path.stem
        wd = section.working_dir
        if wd is not None and not wd.is_absolute():
            wd = (path.parent / wd).resolve()
        self.working_dir = wd

    def write_job_config(self, where: Path) -> Path:
        """The job part alone, for `kvfleet generate --config` (which forbids `soak:`)."""
        where.write_text(yaml.safe_dump(self.job, sort_keys=False))
        return where


FLAGS = {"A": "--config", "B": "--vs"}  # the `kvfleet soak` flag that gives each arm


def load_arm(path: str | Path, key: str = "A") -> SoakArm:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as e:
        raise UsageError(f"{FLAGS.get(key, 'arm ' + key)} {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: not UTF-8 text (byte {e.start})") from None
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
    cfg = validate_job_config(data, str(path))  # the job part must stand on its own
    if section.working_dir is not None:
        wd = section.working_dir if section.working_dir.is_absolute() else path.parent / section.working_dir
        if not (wd / "cluster" / "__main__.py").exists():
            raise UsageError(f"{path}: soak.working_dir {wd} is not a kvfleet checkout "
                             f"(no cluster/__main__.py)")
    return SoakArm(path, data, section, temperature=cfg.sampling.temperature, key=key)
