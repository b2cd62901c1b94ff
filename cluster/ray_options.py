"""What a worker actor may ask Ray for, and whether the cluster it joins can ever give it.

Ray takes some bad requests only as far as the actor's creation (a traceback from inside
the job: `GPU` as a custom resource, a label key it refuses) and waits for ever on others
(an actor that no node can host stays pending; the job waited out its start timeout, 600 s,
then failed with a traceback). So the configs check the first kind when they are loaded
(`resources_error`, `labels_error`: cluster/fleet.py nodes, cluster/config.py workers), and
the worker groups check the second against the cluster's live nodes before they make any
actor (`check_placeable`: cluster/ep_group.py, workers/actor.py RayGroup), with an error that
names the worker, what it asks for and what each node lacks. The check reads the nodes alive
when the job starts: a cluster that an autoscaler would grow later is not foreseen.
"""
from __future__ import annotations

import logging
import os
import re
from typing import Annotated, Any, Mapping

from pydantic import AfterValidator, Field

log = logging.getLogger(__name__)

# Ray's own resources: `GPU` / `CPU` are asked for by num_gpus / num_cpus (a cuda device
# adds num_gpus=1 itself, cluster/placement.py), and ray.init refuses all four as custom ones
RAY_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
_EPS = 1e-6  # (Ray keeps resource amounts in fixed point, 1e-4)


# what a worker asks Ray for without a fleet file (cluster/placement.py)
PLAIN_FIELDS = "workers.num_cpus / workers.resources / workers.label_selector"


def resources_error(resources: Mapping[str, float]) -> str | None:
    """Why Ray would refuse or ignore these custom resources, or None."""
    for k, v in resources.items():
        if k in RAY_RESOURCES:
            return (f"{k!r} is one of Ray's own resources, not a custom one (a cuda device asks "
                    f"for its GPU itself, workers.num_cpus gives the CPUs); name a custom "
                    f"resource the nodes are started with, e.g. kvfleet_cuda")
        if v <= 0:
            return f"{k}={v:g}: an amount must be > 0 (0 asks Ray for nothing: any node would do)"
    return None


# Ray's label syntax (Kubernetes', as ray/_private/label_utils.py checks a label_selector
# when an actor is made): a name of up to 63 characters, alphanumeric at both ends; a key
# may have a DNS-subdomain prefix and "/"; a selector value is `v`, `!v`, `in(a, b)`, `!in(a, b)`
_NAME = r"[a-zA-Z0-9]([a-zA-Z0-9_.-]{0,61}[a-zA-Z0-9])?"
_PREFIX = rf"({_NAME})(\.({_NAME}))*"
_VALUE = rf"!?(in)?\({_NAME}(, ?{_NAME})*\)|!?{_NAME}"


def labels_error(labels: Mapping[str, str]) -> str | None:
    """Why Ray would refuse this label selector when it makes the actor, or None."""
    for key, value in labels.items():
        prefix, _, name = key.rpartition("/")
        if ("/" in key and (len(prefix) > 253 or not re.fullmatch(_PREFIX, prefix))) \
                or not re.fullmatch(_NAME, name):
            return (f"label key {key!r} is not one Ray takes: a name of up to 63 letters, digits, "
                    f"'-', '_' or '.', alphanumeric at both ends (optionally after a DNS prefix and '/')")
        if value and not re.fullmatch(_VALUE, value):
            return (f"label {key}: {value!r} is no Ray label selector value: give a value "
                    f"(`a`), `!a`, `in(a, b)` or `!in(a, b)`, values as label names")
    return None


def _valid_resources(v: dict[str, float]) -> dict[str, float]:
    if why := resources_error(v):
        raise ValueError(why)
    return v


def _valid_labels(v: dict[str, str]) -> dict[str, str]:
    if why := labels_error(v):
        raise ValueError(why)
    return v


# the config fields (fleet nodes' and job workers' `resources` and labels), checked as Ray
# would check them when the actor is made
Resources = Annotated[dict[str, Annotated[float, Field(ge=0.0, allow_inf_nan=False)]],
                      AfterValidator(_valid_resources)]
LabelSelector = Annotated[dict[str, str], AfterValidator(_valid_labels)]


WAIT_ENV = "KVFLEET_WAIT_FOR_NODES"  # 1: an autoscaling cluster adds the nodes (a warning)


def check_placeable(ray, workers: list[tuple[str, Mapping[str, Any]]], field: str) -> None:
    """Raise JobConfigError (a usage error, exit 2) when a worker (name, Ray actor options)
    asks for what no live node of the cluster has, or the workers together ask for more of a
    resource than all the nodes have: they would never all start. `field` names where the
    asks come from (e.g. "workers.fleet FILE"). With KVFLEET_WAIT_FOR_NODES=1 (a cluster
    whose autoscaler adds nodes on demand: KubeRay, `ray up`) the same is a warning, and
    the workers wait for the nodes up to the start timeout."""
    from cluster.config import JobConfigError
    try:
        _check_placeable(ray, workers, field)
    except JobConfigError as e:
        if os.environ.get(WAIT_ENV, "") not in ("1", "true", "yes"):
            raise JobConfigError(f"{e} (on a cluster that adds nodes on demand, set "
                                 f"{WAIT_ENV}=1 to wait for them)") from None
        log.warning("%s; %s=1: waiting for the cluster to add such nodes", e, WAIT_ENV)


def _check_placeable(ray, workers: list[tuple[str, Mapping[str, Any]]], field: str) -> None:
    from cluster.config import JobConfigError
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    for name, opts in workers:
        ask, sel = _ask(opts), dict(opts.get("label_selector") or {})
        lacks = [_lacks(n, ask, sel) for n in nodes]
        if all(lacks):
            where = "; ".join(f"node {_node(n)} lacks {', '.join(l)}" for n, l in zip(nodes[:4], lacks))
            more = f"; and {len(nodes) - 4} more nodes" if len(nodes) > 4 else ""
            gpu = " (a cuda device asks for one GPU that Ray sees on its node)" if "GPU" in ask else ""
            raise JobConfigError(
                f"{field}: worker {name} asks Ray for {_show(ask, sel)}{gpu}, which no node of "
                f"the cluster has, so it would never start ({where or 'no live node'}{more}); "
                f"start a node with them or change {field}")
    total: dict[str, float] = {}
    for _, opts in workers:  # (an actor given no num_cpus holds none once placed)
        for k, v in _ask(dict(opts, num_cpus=opts.get("num_cpus", 0.0))).items():
            total[k] = total.get(k, 0.0) + v
    for k, v in sorted(total.items()):
        have = sum(n["Resources"].get(k, 0.0) for n in nodes)
        if v > have + _EPS:
            raise JobConfigError(
                f"{field}: the {len(workers)} workers ask Ray for {k} {v:g} in all, but the "
                f"cluster's nodes have {have:g}, so they would never all start; start more "
                f"nodes or change {field}")


def _ask(opts: Mapping[str, Any]) -> dict[str, float]:
    ask = {"CPU": float(opts.get("num_cpus", 1.0)), "GPU": float(opts.get("num_gpus", 0.0))}
    ask.update({k: float(v) for k, v in (opts.get("resources") or {}).items()})
    return {k: v for k, v in ask.items() if v > 0}


def _lacks(node: dict, ask: dict[str, float], sel: dict[str, str]) -> list[str]:
    """What of the ask a node does not have (empty: it could host the worker)."""
    res, labels = node.get("Resources", {}), node.get("Labels") or {}
    out = [f"{k} {v:g} (has {res.get(k, 0):g})" for k, v in ask.items() if res.get(k, 0.0) + _EPS < v]
    out += [f"label {k}={v}" + (f" (has {labels[k]})" if k in labels else "")
            for k, v in sel.items() if not _selects(v, labels.get(k))]
    return out


def _selects(selector: str, value: str | None) -> bool:
    """Whether a label value (None: the node has no such label) meets a Ray label selector
    value: `v`, `!v`, `in(a, b)`, `!in(a, b)`."""
    neg = selector.startswith("!")
    s = selector[1:] if neg else selector
    if s.startswith("in(") and s.endswith(")"):
        choices = {c.strip() for c in s[3:-1].split(",")}
    elif s.startswith("(") and s.endswith(")"):
        choices = {c.strip() for c in s[1:-1].split(",")}
    else:
        choices = {s}
    return (value in choices) != neg


def _show(ask: dict[str, float], sel: dict[str, str]) -> str:
    parts = [f"{k} {v:g}" for k, v in ask.items()] + [f"label {k}={v}" for k, v in sel.items()]
    return ", ".join(parts)


def _node(n: dict) -> str:
    return f"{n.get('NodeManagerAddress', '?')} ({str(n.get('NodeID', ''))[:8]})"
