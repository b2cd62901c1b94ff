"""JobConfig: the typed, frozen config of a generation job.

Sources, later ones winning: the model defaults below < a YAML file (`--config`) < the
environment (`KV8=1`, `KV_TQ=4`, `KVFLEET_SLOTS=8`, ...; mapped in `env_overrides`, the one
place that reads them) < command-line flags. Every error names the file (or variable) and
the field path, and carries the bad value.

    model: models/kvfleet-mini   # relative paths resolve against the repo root
    kv: f32                      # f32 | kv8 | tq4 | polar2..6
    slots: 8                     # KV slots per worker (concurrent sequences)
    max_context: 2048            # tokens per slot, prompt + completion
    block_size: 16               # tokens per KV block
    prefill_chunk: 256           # prompt tokens per scheduler step, over all slots
    sampling: {max_tokens: 64, temperature: 0.0, top_p: 1.0, seed: 0}
    workers: {count: 1, fleet: null, num_cpus: 1, resources: {}, label_selector: {},
              experts: replicated,   # or sharded: expert parallel (cluster/ep_group.py)
              step_timeout_s: 600}   # a worker's step running longer is hung; 0/null: none
    kv_cache_dir: null           # a dir: save each request's KV, resume shared prefixes
    kv_cache_format: arrow       # arrow | coli (the C engine's .coli_kv)
"""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cluster.cli import UsageError
from cluster.ray_options import LabelSelector, Resources
from cluster.yaml_config import DuplicateKeyError, load_yaml
from kernels.tiers import TIERS, get_tier

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO_ROOT / "models" / "kvfleet-mini"


class JobConfigError(UsageError):
    """A config file, variable or flag that cannot describe a job: names where and what."""


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Sampling(_Frozen):
    """Per-request defaults; a prompt line may override each of them."""
    max_tokens: int = Field(64, ge=1)
    # 0 = greedy; at most float32's largest, as the samplers take it (cluster/requests.py)
    temperature: float = Field(0.0, ge=0.0, le=3.4028234663852886e38, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int = Field(0, ge=0, lt=2 ** 64)  # (uint64, as the samplers' counters; a line
    # without a seed gets one mixed from this and its id: cluster/jobs/generate.request_seed)


_TIMEOUT_RULE = "must be a positive number of seconds, or 0 (or null) for no timeout"


class Workers(_Frozen):
    """Where worker actors go. `fleet` names a fleet file (cluster/fleet.py) instead of a count."""
    count: int = Field(1, ge=1)
    fleet: Path | None = None
    num_cpus: float = Field(1.0, ge=0.0)
    # e.g. {"cpu_worker": 1}: custom resources, amounts > 0 and finite (cluster/ray_options.py)
    resources: Resources = Field(default_factory=dict)
    label_selector: LabelSelector = Field(default_factory=dict)  # e.g. {"kind": "cpu"}
    runtime: Literal["ray", "inprocess"] = "ray"  # inprocess: no Ray at all (tests, bench)
    ray_num_cpus: int | None = Field(None, ge=1)  # CPUs of a local Ray started by the job
    # sharded: each worker holds a shard of the routed experts (cluster/ep_group.py)
    experts: Literal["replicated", "sharded"] = "replicated"
    # Seconds a replicated worker's step may run before it counts as hung: its actor is
    # killed and its sequences re-run elsewhere (workers/actor.py RayGroup). Absolute, so it
    # must cover the slowest host's longest step (a CPU worker's prefill chunk). 0 or null:
    # no timeout (a hung worker then holds the job). Expert-parallel groups find a hung
    # worker by pinging a step that runs long or outlives a peer's failed one
    # (cluster/ep_group.py) and ignore it.
    step_timeout_s: float | None = 600.0

    @field_validator("step_timeout_s", mode="before")
    @classmethod
    def _not_a_switch(cls, v: Any) -> Any:
        if isinstance(v, bool):  # YAML `yes` would be a 1 s timeout: every step "hung"
            raise ValueError(_TIMEOUT_RULE)
        return v

    @field_validator("step_timeout_s")
    @classmethod
    def _timeout_or_none(cls, v: float | None) -> float | None:
        if v is None or v == 0:
            return None
        if not (math.isfinite(v) and v > 0):
            raise ValueError(_TIMEOUT_RULE)
        return v


class JobConfig(_Frozen):
    model: Path = DEFAULT_MODEL
    kv: str = "f32"
    slots: int = Field(8, ge=1)
    max_context: int = Field(2048, ge=2)
    block_size: int = Field(16, ge=1)
    prefill_chunk: int = Field(256, ge=1)
    sampling: Sampling = Sampling()
    workers: Workers = Workers()
    flush_every: int = Field(32, ge=1)  # results per crash-safe part file
    progress_every_s: float = Field(10.0, gt=0)  # log-line progress period off a TTY
    # saved KV per request (`cache` field, default the id) on each worker's host; None = off
    kv_cache_dir: Path | None = None
    kv_cache_format: Literal["arrow", "coli"] = "arrow"

    @field_validator("kv")
    @classmethod
    def _known_tier(cls, v: str) -> str:
        return get_tier(v).name  # TierError (a ValueError) names the tier and the choices

    @field_validator("model")
    @classmethod
    def _repo_relative(cls, v: Path) -> Path:
        return v if v.is_absolute() else REPO_ROOT / v

    @field_validator("kv_cache_dir", mode="before")
    @classmethod
    def _not_empty(cls, v: Any) -> Any:
        if isinstance(v, str) and not v.strip():  # (Path("") is the cwd: saved KV went there)
            raise ValueError("must be a directory path, or null (unset) for no saved KV")
        return v

    @field_validator("kv_cache_dir")
    @classmethod
    def _absolute_dir(cls, v: Path | None) -> Path | None:
        return None if v is None else v.expanduser().absolute()  # the driver's cwd

    @model_validator(mode="after")
    def _context_fits_blocks(self) -> "JobConfig":
        if self.max_context < self.block_size:
            raise ValueError(f"max_context={self.max_context} is smaller than "
                             f"block_size={self.block_size}")
        return self

    def model_ref(self) -> str:
        """The model path as a worker on another node should resolve it (repo-relative when
        it lies inside the repo, so a `--working-dir .` job finds it on every node)."""
        try:
            return str(self.model.relative_to(REPO_ROOT))
        except ValueError:
            return str(self.model)


def resolve_model(ref: str | Path) -> Path:
    """Inverse of JobConfig.model_ref on the node that loads the model."""
    p = Path(ref)
    return p if p.is_absolute() else REPO_ROOT / p


# name -> (field path, parser). KV8 / KV_TQ / KV_TQ_POLAR are combined in _tier_from_env.
ENV_FIELDS: dict[str, tuple[str, Any]] = {
    "KVFLEET_MODEL": ("model", lambda v: str(Path(v).resolve())),  # relative to the cwd
    "KVFLEET_KV": ("kv", str),
    "KVFLEET_SLOTS": ("slots", int),
    "KVFLEET_MAX_CONTEXT": ("max_context", int),
    "KVFLEET_BLOCK_SIZE": ("block_size", int),
    "KVFLEET_PREFILL_CHUNK": ("prefill_chunk", int),
    "KVFLEET_MAX_TOKENS": ("sampling.max_tokens", int),
    "KVFLEET_TEMPERATURE": ("sampling.temperature", float),
    "KVFLEET_TOP_P": ("sampling.top_p", float),
    "KVFLEET_SEED": ("sampling.seed", int),
    "KVFLEET_WORKERS": ("workers.count", int),
    "KVFLEET_STEP_TIMEOUT_S": ("workers.step_timeout_s", float),  # 0: no timeout
    "KVFLEET_KV_CACHE_DIR": ("kv_cache_dir", str),
    "KVFLEET_KV_CACHE_FORMAT": ("kv_cache_format", str),
}
# every variable that sets a job field: what a soak withholds from an arm's rounds so that
# it runs its config as written (cluster/soak/config.py asks each arm's checkout for its own)
JOB_ENV = frozenset(ENV_FIELDS) | {"KV8", "KV_TQ", "KV_TQ_POLAR"}


_SWITCH_OFF = ("", "0", "false", "no", "off")  # (as KVFLEET_METAL / COLI_METAL read them)


def _switch(env: Mapping[str, str], name: str) -> bool:
    """A switch variable is on unless unset, empty, 0, false, no or off (any case): KV8=false
    must not turn kv8 on."""
    return env.get(name, "").strip().lower() not in _SWITCH_OFF


def _tier_from_env(env: Mapping[str, str]) -> str | None:
    """The C engine's knobs: KV8=1 -> kv8; KV_TQ=4 -> tq4; KV_TQ=B with KV_TQ_POLAR=1 -> polarB.
    KV_TQ wins over KV8 (with a warning)."""
    kv8 = _switch(env, "KV8")
    tq = env.get("KV_TQ", "").strip()
    polar = _switch(env, "KV_TQ_POLAR")
    if tq in ("", "0"):
        if polar:
            raise JobConfigError("environment KV_TQ_POLAR=1 needs KV_TQ=<bits> (2..6)")
        return "kv8" if kv8 else None
    if not tq.isdigit():
        raise JobConfigError(f"environment KV_TQ={tq!r} must be a bit count")
    name = f"polar{tq}" if polar else f"tq{tq}"
    if name not in TIERS:
        raise JobConfigError(f"environment KV_TQ={tq!r}{' KV_TQ_POLAR=1' if polar else ''} "
                             f"gives tier {name!r}, which does not exist; tiers: {sorted(TIERS)}")
    if kv8:
        log.warning("both KV8 and KV_TQ=%s are set; KV_TQ wins (tier %s)", tq, name)
    return name


def env_overrides(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The one place that maps environment variables onto JobConfig fields (a nested dict)."""
    env = os.environ if env is None else env
    out: dict[str, Any] = {}
    for var, (path, kind) in ENV_FIELDS.items():
        if env.get(var, "") == "":
            continue
        try:
            value = kind(env[var])
        except ValueError:
            raise JobConfigError(f"environment {var}={env[var]!r} (field {path}) "
                                 f"must be {getattr(kind, '__name__', 'a path')}") from None
        _set(out, path, value)
    tier = _tier_from_env(env)
    if tier is not None:
        if "kv" in out and out["kv"] != tier:
            log.warning("KVFLEET_KV=%s overrides the KV8/KV_TQ tier %s", out["kv"], tier)
        else:
            out["kv"] = tier
    return out


def _set(d: dict, path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for p in parents:
        d = d.setdefault(p, {})
    d[leaf] = value


def _merge(base: dict, over: Mapping) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def _validate(data: dict, source: str, origin: Mapping[str, str] | None = None) -> JobConfig:
    """origin: field path -> what set it (an environment variable, "flags"), named in errors."""
    try:
        return JobConfig.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            where = ".".join(str(p) for p in err["loc"]) or "<top>"
            by = next((f" (from {o})" for f, o in (origin or {}).items()
                       if where == f or where.startswith(f + ".")), "")
            got = f" (got {err['input']!r})" if "input" in err and err["type"] != "missing" else ""
            lines.append(f"{source}: {where}{by}: {err['msg']}{got}")
        raise JobConfigError("; ".join(lines)) from None


def _paths(d: Mapping, prefix: str = "") -> list[str]:
    """The leaf field paths of a nested dict ("sampling.seed")."""
    out = []
    for k, v in d.items():
        path = f"{prefix}{k}"
        out += _paths(v, path + ".") if isinstance(v, Mapping) else [path]
    return out


def _fleet_file_hint(data: dict, path: Path) -> str | None:
    """What to do instead when `path` is a fleet file (cluster/fleet.py), the mistake of
    passing it as the job config: pydantic only listed `nodes` and `plan` as extra inputs.
    None when it is not one. (The inverse of `kvfleet plan`'s hint for a job config.)"""
    from cluster.fleet import Fleet  # (not at import: the planner and the model code)
    # a fleet file has `nodes` and no field that only a job config has (`model` is in both):
    # a job config with a stray `nodes` keeps its own error
    job_only = set(JobConfig.model_fields) - set(Fleet.model_fields)
    if "nodes" not in data or set(data) & job_only:
        return None
    try:  # a relative workers.fleet resolves against the repo root (cluster/placement.py)
        ref = path.resolve().relative_to(REPO_ROOT)
    except ValueError:
        ref = path.resolve()
    return (f"is a fleet file (`nodes` and their memory: cluster/fleet.py), not a job config; "
            f"to run a job on this fleet, name it in a job config as `workers: {{fleet: {ref}}}` "
            f"(as configs/sharded.yaml does) and pass that with --config; to plan it: "
            f"kvfleet plan --config {path}")


def validate_job_config(data: dict, source: str) -> JobConfig:
    """A JobConfig from a plain mapping (e.g. the job part of a soak arm); errors name `source`."""
    return _validate(data, source)


def load_job_config(path: str | Path | None = None, *, env: Mapping[str, str] | None = None,
                    overrides: Mapping[str, Any] | None = None) -> JobConfig:
    """YAML file (optional) < environment < `overrides` (a nested dict, e.g. from flags)."""
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise JobConfigError(f"cannot read config {source}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise JobConfigError(f"config {source}: not UTF-8 text (byte {e.start})") from None
        try:
            loaded = load_yaml(text)
        except DuplicateKeyError as e:  # (PyYAML kept the last: `slots: 8` then 9 ran with 9)
            raise JobConfigError(f"{source}: {e}") from None
        except yaml.YAMLError as e:
            raise JobConfigError(f"{source}: not valid YAML: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise JobConfigError(f"{source}: top level must be a mapping, got "
                                 f"{type(loaded).__name__}")
        data = loaded or {}
    try:
        cfg = _validate(data, source)  # file errors are reported against the file alone
    except JobConfigError:
        hint = _fleet_file_hint(data, Path(path)) if path is not None else None
        if hint:
            raise JobConfigError(f"{source}: {hint}") from None
        raise
    env = os.environ if env is None else env
    from_env = env_overrides(env)
    if not from_env and not overrides:
        return cfg
    # the merged result is checked once (a bad variable that a flag overrides is no error),
    # each bad field named with the variable or the flags that set it
    by_path = {path: var for var, (path, _) in ENV_FIELDS.items() if env.get(var, "") != ""}
    origin = {p: by_path.get(p, "KV8 / KV_TQ") for p in _paths(from_env)}
    origin.update((p, "flags") for p in _paths(overrides or {}))
    return _validate(_merge(_merge(data, from_env), overrides or {}),
                     source + (" + environment" if from_env else "")
                     + (" + flags" if overrides else ""), origin)


# Every KVFLEET_ variable some code reads: the job fields above, and the backends' own knobs
# (kernels/metal/backend.py; kernels/cuda/attention.py, kernels/cuda/_build.py). A test
# checks that every KVFLEET_ name in the source is here, so that the list cannot go stale.
KNOWN_ENV = frozenset(ENV_FIELDS) | {
    "KVFLEET_METAL", "KVFLEET_WAIT_FOR_NODES",
    "KVFLEET_CUDA_PDL", "KVFLEET_CUDA_WGMMA", "KVFLEET_CUDA_TMA", "KVFLEET_CUDA_KV8_CVT",
    "KVFLEET_CUDA_WG_TUNING", "KVFLEET_CUDA_LINEINFO", "KVFLEET_CUDA_PTXAS_V",
}


def warn_unknown_env(env: Mapping[str, str] | None = None) -> list[str]:
    """Warns once per KVFLEET_ variable of `env` that no code reads, with the closest known
    name (as vLLM warns of an unknown VLLM_ one): a misspelt one (KVFLEET_SLOTS without its
    S) was ignored silently. Not an error: another build's variable may be meant. Returns
    their names."""
    import difflib
    env = os.environ if env is None else env
    names = sorted(k for k in env if k.startswith("KVFLEET_") and k not in KNOWN_ENV)
    for name in names:
        close = difflib.get_close_matches(name, sorted(KNOWN_ENV), n=1)
        log.warning("environment %s is not a kvfleet variable: it is ignored%s", name,
                    f" (did you mean {close[0]}?)" if close else "")
    return names
