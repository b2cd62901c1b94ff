"""The fleet config: which machines there are, what memory each device may use.

    # configs/fleets/h200x2.yaml
    model: ../models/glm-5.2.json      # optional; relative to this file
    plan: {ctx: 131072, kv: kv8, experts: int4}
    nodes:
      - name: h200-box
        kind: cuda                     # cuda | cpu | metal
        devices: 2                     # GPUs (cpu: memory domains; metal: 1)
        memory: 141                    # GB (1e9 bytes) per device, or "auto" (free memory)
        reserve_gb: 4                  # kept back per device (CUDA context, activations)
        slots: 2                       # KV slots per device
        resources: {h200: 2}           # extra Ray custom resources (optional)
        labels: {zone: a}              # Ray node labels (optional)

Errors name the file and the field path: "fleet.yaml: nodes.1.memory: ...".

`plan_fleet` is the one way to plan a fleet: `kvfleet plan` and the generate job's placement
(cluster/placement.py) both call it, so the same fleet fits the job and `kvfleet plan
--as-job` (loaded) or neither; the plain plan sizes it as the C engine would run it.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Mapping

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo, field_validator, model_validator

from cluster import planner
from cluster.footprint import WEIGHT_FORMATS, Footprint
from cluster.memory_probe import ProbeError
from cluster.planner import GB, SHADOW_FLOOR_GB, DeviceBudget
from cluster.ray_options import LabelSelector, Resources
from cluster.yaml_config import DuplicateKeyError, load_yaml
from kernels.tiers import get_tier


# The most GB (1e9 bytes) one device of each kind may be given (memory, reserve_gb, a
# --free-gb): well above any device there is (the largest GPUs have 288 GB, Macs 512 GB of
# unified memory, the largest single hosts tens of TB of RAM), so that a bigger size is one
# in other units or a typo, which would plan a device with room for every expert: 81920 is an
# 80 GB card in MiB, 80000000000 in bytes (and past about 1.8e299 GB, round(size * GB)
# overflows). A cpu device is one worker's memory domain of a host, so it may be far bigger.
MAX_GB = {"cuda": 2000.0, "metal": 2000.0, "cpu": 64000.0}
UNITS_HINT = "sizes are in GB (1e9 bytes): an 80 GB card is 80, not 81920 (MiB) or 80000000000 (bytes)"


def size_error(kind: str | None, gb_: float, of: str = "") -> str | None:
    """Why `gb_` GB is no size for one device of `kind` (None: an unknown kind, the largest
    limit), or None when it may be one; `of` says whose size it is ("node a")."""
    limit = MAX_GB.get(kind, max(MAX_GB.values()))
    if gb_ <= limit:
        return None
    what = f"a {kind} device" if kind in MAX_GB else "any device"
    return (f"{gb_:g} GB{f' ({of})' if of else ''} is more than {what} has (at most {limit:g} "
            f"GB); {UNITS_HINT}")


class FleetError(ValueError):
    """A fleet file that cannot be used: names the file, the field path and the value."""


class _Frozen(BaseModel):
    # strict: lax mode took `devices: true` as 1, `slots: '2'` as 2 and `reserve_gb: true` as
    # 1 GB; a float field still takes an int (reserve_gb: 4)
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Node(_Frozen):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    kind: Literal["cuda", "cpu", "metal"]
    devices: int = Field(1, ge=1)
    memory: float | Literal["auto"]
    reserve_gb: float = Field(2.0, ge=0, allow_inf_nan=False)
    slots: int = Field(1, ge=1)
    resources: Resources = Field(default_factory=dict)
    labels: LabelSelector = Field(default_factory=dict)

    @field_validator("memory", mode="before")
    @classmethod
    def _memory(cls, v: Any) -> Any:
        if v == "auto":
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"must be a positive size in GB or 'auto', got {v!r}")
        return float(v)

    @field_validator("memory", "reserve_gb")
    @classmethod
    def _plausible(cls, v: Any, info: ValidationInfo) -> Any:
        """A size no device of the node's kind has (MAX_GB): one in MiB or bytes."""
        kind = info.data.get("kind")
        if v != "auto" and (why := size_error(kind, v, f"node {info.data.get('name', '?')}, kind {kind}")):
            raise ValueError(why)
        return v

    @model_validator(mode="after")
    def _fits(self) -> "Node":
        if self.memory != "auto" and self.reserve_gb >= self.memory:
            raise ValueError(f"reserve_gb={self.reserve_gb} leaves nothing of memory={self.memory} GB")
        if self.kind == "metal" and self.devices != 1:
            raise ValueError(f"a metal node has one unified memory, devices={self.devices} must be 1")
        return self


class PlanDefaults(_Frozen):
    """Planning knobs a fleet file may set; `kvfleet plan` flags override them."""
    ctx: int = Field(32768, ge=1)
    kv: str = "f32"
    experts: str = "bf16"
    shadow_floor_gb: float = Field(SHADOW_FLOOR_GB, ge=0, allow_inf_nan=False)

    @field_validator("shadow_floor_gb")
    @classmethod
    def _floor(cls, v: float) -> float:
        if why := size_error("cuda", v):  # (the size of a cuda device that gets a shadow)
            raise ValueError(why)
        return v

    @field_validator("kv")
    @classmethod
    def _tier(cls, v: str) -> str:
        return get_tier(v).name  # TierError (a ValueError) names the tier and the choices

    @field_validator("experts")
    @classmethod
    def _fmt(cls, v: str) -> str:
        if v not in WEIGHT_FORMATS:
            raise ValueError(f"unknown expert format {v!r}; choose one of {sorted(WEIGHT_FORMATS)}")
        return v


@dataclass(frozen=True)
class DeviceSpec:
    node: Node
    index: int

    @property
    def name(self) -> str:
        return f"{self.node.name}/{self.node.kind}{self.index}"


class Fleet(_Frozen):
    model: str | None = None
    plan: PlanDefaults = Field(default_factory=PlanDefaults)
    nodes: list[Node] = Field(min_length=1)
    _source: str = PrivateAttr("<dict>")

    @model_validator(mode="after")
    def _unique(self) -> "Fleet":
        names = [n.name for n in self.nodes]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"node names must be unique, repeated: {dup}")
        return self

    @property
    def source(self) -> str:
        return self._source

    def model_path(self) -> Path | None:
        """`model` resolved against the fleet file's folder."""
        if self.model is None:
            return None
        p = Path(self.model)
        return p if p.is_absolute() or self._source == "<dict>" else Path(self._source).parent / p

    def devices(self) -> list[DeviceSpec]:
        return [DeviceSpec(n, i) for n in self.nodes for i in range(n.devices)]

    @classmethod
    def from_dict(cls, data: Any, source: str = "<dict>") -> "Fleet":
        if not isinstance(data, dict):
            raise FleetError(f"{source}: expected a mapping with 'nodes', got {type(data).__name__}")
        try:
            fleet = cls.model_validate(data)
        except ValidationError as e:
            raise FleetError("\n".join(_describe(source, err) for err in e.errors())) from None
        fleet._source = source
        return fleet

    @classmethod
    def from_file(cls, path: str | Path) -> "Fleet":
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise FleetError(f"{path}: no such fleet file") from None
        except OSError as e:  # a directory, no permission, ...
            raise FleetError(f"{path}: cannot read fleet file ({e.strerror})") from None
        except UnicodeDecodeError as e:
            raise FleetError(f"{path}: the fleet file is not UTF-8 text (byte {e.start})") from None
        try:
            data = load_yaml(text)
        except DuplicateKeyError as e:
            raise FleetError(f"{path}: {e}") from None
        except yaml.YAMLError as e:
            raise FleetError(f"{path}: not valid YAML: {e}") from None
        return cls.from_dict(data, source=str(path))


def _describe(source: str, err: dict) -> str:
    loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
    msg = re.sub(r"^Value error, ", "", err["msg"])
    got = "" if err["type"] in ("value_error", "missing") else f" (got {err.get('input')!r:.60})"
    return f"{source}: {loc}: {msg}{got}"


def device_budgets(fleet: Fleet, free_bytes: Mapping[str, int] | Callable[[DeviceSpec], int] | None = None,
                   slots: int | None = None) -> list[DeviceBudget]:
    """The planner's view of every device. free_bytes: free memory of "auto" devices, by
    device name or as a function (tests pass numbers; runs pass cluster.memory_probe.free_bytes,
    whose ProbeError becomes a FleetError naming the file, node and device).
    slots: overrides every node's `slots` when given."""
    out = []
    for i, node in enumerate(fleet.nodes):
        for spec in (DeviceSpec(node, j) for j in range(node.devices)):
            mem = round(node.memory * GB) if node.memory != "auto" else _auto(fleet, i, spec, free_bytes)
            out.append(DeviceBudget(spec.name, node.kind, int(mem), round(node.reserve_gb * GB),
                                    slots or node.slots, auto=node.memory == "auto"))
    return out


def _auto(fleet: Fleet, i: int, spec: DeviceSpec,
          free_bytes: Mapping[str, int] | Callable[[DeviceSpec], int] | None) -> int:
    if free_bytes is None:
        raise FleetError(f"{fleet.source}: node {spec.node.name} has memory 'auto' but no free "
                         "memory was measured for it; give memory in GB")
    try:
        mem = free_bytes(spec) if callable(free_bytes) else free_bytes.get(spec.name)
    except ProbeError as e:
        raise FleetError(f"{fleet.source}: nodes.{i}.memory: 'auto', but the free memory of device "
                         f"{spec.name} could not be measured on this machine ({e}); give memory "
                         "in GB") from None
    if mem is None:
        raise FleetError(f"{fleet.source}: no free memory given for device {spec.name} (memory 'auto')")
    return mem


def plan_fleet(fleet: Fleet, fp: Footprint,
               free_bytes: Mapping[str, int] | Callable[[DeviceSpec], int] | None = None, *,
               tier: str | None = None, ctx: int | None = None, experts: str | None = None,
               slots: int | None = None, usage: np.ndarray | None = None,
               loaded: bool = False, block: int = planner.BLOCK) -> planner.Plan:
    """The budget plan of `fleet` for the model `fp`. tier / ctx / experts: None takes the
    fleet file's `plan.*`; the shadow floor is always its `plan.shadow_floor_gb` (loaded
    plans set aside no shadow: planner.shadow_token_bytes). slots: overrides every node's
    `slots`. loaded: cuda devices counted as a kvfleet job's workers hold them
    (planner.plan). block: the KV pool's tokens per block (the job's block_size). Raises
    FleetError or PlanError."""
    d = fleet.plan
    if tier is None and (why := fp.tier_error(d.kv)):
        raise FleetError(f"{fleet.source}: plan.kv: {why} ({fp.config.source})")
    return planner.plan(fp, device_budgets(fleet, free_bytes, slots=slots),
                        tier=d.kv if tier is None else tier, ctx=d.ctx if ctx is None else ctx,
                        experts=d.experts if experts is None else experts, usage=usage,
                        shadow_floor_bytes=round(d.shadow_floor_gb * GB), loaded=loaded, block=block)
