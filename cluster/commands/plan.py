"""`kvfleet plan`: what each device of a fleet holds (dense, KV, shadow, pinned experts).

    kvfleet plan --config configs/fleets/h200x2.yaml [--model-config FILE] [--as-job] [--json]
    kvfleet plan --model-config configs/models/glm-5.2.json --ctx 262144 [--slots N] [--kv kv8] --json

Without a fleet file it prints the KV pool of `slots` slots at `ctx` tokens for the chosen
tier and, for comparison, every tier. tq4 and polar need power-of-two row widths (2..2048):
for a model without them they show as unavailable, and asking for one (--kv, the fleet's
plan.kv) is an error, as the job's KV pool refuses them.

A fleet plan counts weights in the checkpoint's format (or `--experts`), as the C engine
stores them. `--as-job` plans the fleet as `kvfleet generate` does instead (its placement,
cluster/placement.py): bf16 experts, and on cuda devices the dense weights and pinned
experts as the float32 arrays its CuPy workers upload, and the KV pool its workers
allocate: the main layers' rows, no MTP layer's or DSA indexer rows, and no fp8 shadow beside
it (their pool is on the GPU and takes host rows in once; cluster/planner.py, loaded). The
plain plan sets the C engine's shadow aside on a cuda device of at least the fleet's
plan.shadow_floor_gb; the table and JSON say which (shadow_tier, shadow_floor_bytes).
A fleet plan counts each slot's context in whole KV pool blocks, as the job's pool holds it:
--block-size tokens (the job's block_size), 16 by default.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import yaml

from cluster.cli import UsageError
from cluster.config import REPO_ROOT
from cluster.fleet import Fleet, FleetError, plan_fleet, size_error
from cluster.footprint import WEIGHT_FORMATS, Footprint
from cluster.memory_probe import free_bytes
from cluster.planner import BLOCK, GB, PlanError, usage_error
from kernels.tiers import TIERS
from workers.config import ConfigError
from workers.weights import EXPERT_FORMAT


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="plan memory per device: dense weights, KV pool, shadow, pinned experts",
                       description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, help="fleet YAML (nodes, devices, memory)")
    p.add_argument("--model-config", type=Path, help="model config.json (default: the fleet's `model`)")
    p.add_argument("--ctx", type=int, help="context tokens per slot (default: the fleet's plan.ctx)")
    p.add_argument("--slots", type=int, help="slots per device (overrides every node's `slots`)")
    p.add_argument("--block-size", type=int, help=f"tokens per KV pool block, the job's block_size (default "
                   f"{BLOCK}): a slot holds ceil(ctx / block size) blocks")
    p.add_argument("--kv", choices=sorted(TIERS), help="KV tier (default: the fleet's plan.kv, else f32)")
    p.add_argument("--experts", choices=sorted(WEIGHT_FORMATS), help="routed expert weight format")
    p.add_argument("--as-job", action="store_true",
                   help=f"plan as kvfleet generate runs the fleet: {EXPERT_FORMAT} experts, a cuda "
                        "device's dense weights and pinned experts as float32 (what its workers upload), "
                        "no fp8 shadow beside its workers' device pools")
    p.add_argument("--usage", type=Path, help="expert usage counts [MoE layers, experts] (.npy or .json; "
                   "rows of MTP layers, which kvfleet does not load, are ignored)")
    p.add_argument("--free-gb", action="append", default=[], metavar="DEVICE=GB",
                   help="free memory of an 'auto' device instead of measuring it (repeatable)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def _positive(name: str, v: int | None) -> None:
    if v is not None and v < 1:
        raise UsageError(f"{name} must be >= 1, got {v}")


def _tier_fits(fp: Footprint, tier: str | None) -> None:
    """--kv TIER must be one the job's KV pool takes at the model's widths."""
    if tier is not None and (why := fp.tier_error(tier)):
        raise UsageError(f"--kv {tier}: {why} ({fp.config.source})")


def _footprint(path: Path | None) -> Footprint:
    if path is None:
        raise UsageError("no model: pass --model-config FILE or set `model:` in the fleet file")
    try:
        return Footprint.from_file(path)
    except ConfigError as e:
        raise UsageError(str(e)) from None


def _usage(path: Path | None, fp: Footprint) -> np.ndarray | None:
    if path is None:
        return None
    try:
        raw = np.load(path) if path.suffix == ".npy" else json.loads(path.read_text())
        usage = np.asarray(raw, dtype=np.float64)
    except (OSError, ValueError, TypeError) as e:  # (TypeError: a JSON object, not a list)
        raise UsageError(f"--usage {path}: cannot read expert usage counts ({e})") from None
    if why := usage_error(fp, usage):  # (the planner's own error named neither flag nor file)
        raise UsageError(f"--usage {path}: {why} (model {fp.config.source})")
    return usage


def _free(specs: list[str], fleet: Fleet) -> dict[str, int]:
    """--free-gb DEVICE=GB, each of an 'auto' device of `fleet`, at most what a device of its
    kind may have (cluster.fleet.MAX_GB: a size in MiB or bytes is an error)."""
    kinds = {d.name: d.node.kind for d in fleet.devices() if d.node.memory == "auto"}
    out = {}
    for s in specs:
        name, _, val = s.partition("=")
        try:
            size = float(val)
        except ValueError:
            raise UsageError(f"--free-gb {s!r}: expected DEVICE=GB, e.g. node/cuda0=120") from None
        if not math.isfinite(size) or size < 0:
            raise UsageError(f"--free-gb {s!r}: GB must be a finite number >= 0, got {val!r}")
        if name not in kinds:  # (a typo would be measured on this machine instead)
            raise UsageError(f"--free-gb {name}: not an 'auto' device of {fleet.source}; its "
                             f"'auto' devices: {list(kinds) or 'none'}")
        if why := size_error(kinds[name], size):
            raise UsageError(f"--free-gb {s!r}: {why}")
        out[name] = round(size * GB)
    return out


FLEET_ONLY = (("usage", "--usage"), ("experts", "--experts"), ("free_gb", "--free-gb"),
              ("as_job", "--as-job"), ("block_size", "--block-size"))


def _job_config_hint(path: Path) -> str | None:
    """What to run instead when `path` is a generate job config (no `nodes`, job fields):
    the plan of its fleet file, as the job makes it. None when it is not one."""
    from cluster.config import JobConfig, JobConfigError, load_job_config  # (not at import: cli)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    # a job config has a field that no fleet file has (`model` is in both): a fleet file with
    # a typo in `nodes` must keep its own error, not be told it is a job config
    job_only = set(JobConfig.model_fields) - set(Fleet.model_fields)
    if not isinstance(data, dict) or "nodes" in data or not set(data) & job_only:
        return None
    head = f"--config {path}: is a job config (kvfleet generate --config), not a fleet file"
    try:
        cfg = load_job_config(path, env={})
    except JobConfigError:
        return head + " (and not a valid one); pass a fleet file (configs/fleets/*.yaml)"
    if cfg.workers.fleet is None:
        return (head + f"; it has no workers.fleet (its {cfg.workers.count} worker(s) are "
                f"sized by `slots` and max_context alone); pass a fleet file (configs/fleets/*.yaml)")
    fleet = cfg.workers.fleet if cfg.workers.fleet.is_absolute() else REPO_ROOT / cfg.workers.fleet
    return (head + f". Its fleet, planned as the job plans it: kvfleet plan --config "
            f"{_shown(fleet)} --model-config {_shown(cfg.model / 'config.json')} --ctx "
            f"{cfg.max_context} --kv {cfg.kv} --experts {EXPERT_FORMAT} --as-job"
            + (f" --slots {cfg.slots}" if "slots" in data else "")
            + (f" --block-size {cfg.block_size}" if cfg.block_size != BLOCK else ""))


def _shown(p: Path) -> str:
    """p relative to the working directory where it lies under it (as a user types it)."""
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


def run(args: argparse.Namespace) -> int:
    _positive("--ctx", args.ctx)
    _positive("--slots", args.slots)
    _positive("--block-size", args.block_size)
    if args.config is None:
        given = [flag for attr, flag in FLEET_ONLY if getattr(args, attr)]
        if given:  # (the pool table does not use them: it would print as if it had)
            one = len(given) == 1
            raise UsageError(f"{', '.join(given)} {'applies' if one else 'apply'} to a fleet plan: "
                             f"pass the fleet file with --config, or leave "
                             f"{'it' if one else 'them'} out")
        return _pool_only(args)
    if args.as_job and args.experts not in (None, EXPERT_FORMAT):
        raise UsageError(f"--as-job plans the {EXPERT_FORMAT} experts kvfleet generate loads; "
                         f"--experts {args.experts} is not what it runs: drop one of them")
    experts = EXPERT_FORMAT if args.as_job else args.experts
    try:
        try:
            fleet = Fleet.from_file(args.config)
        except FleetError:
            hint = _job_config_hint(args.config)
            if hint:
                raise UsageError(hint) from None
            raise
        fp = _footprint(args.model_config or fleet.model_path())
        _tier_fits(fp, args.kv)  # (the fleet's plan.kv is checked by plan_fleet, naming it)
        free, probed = _free(args.free_gb, fleet), []

        def measure(spec):
            if spec.name in free:
                return free[spec.name]
            probed.append(spec.name)
            return free_bytes(spec)  # read on this machine, also for a device of another node

        p = plan_fleet(fleet, fp, measure, tier=args.kv, ctx=args.ctx, experts=experts,
                       slots=args.slots, usage=_usage(args.usage, fp), loaded=args.as_job,
                       block=args.block_size or BLOCK)
    except (FleetError, PlanError) as e:  # a failed probe is a FleetError naming file and device
        raise UsageError(str(e)) from None
    out = p.to_dict()
    out["measured_here"] = probed
    if args.as_job:
        out["as_job"] = True
    if p.expert_format.name != EXPERT_FORMAT:  # a plan for another runtime; say what the job does
        out["warnings"].append(
            f"experts sized as {p.expert_format.name}; kvfleet generate loads {EXPERT_FORMAT} experts "
            f"(workers/weights.py reads no {p.expert_format.name} ones) and plans and splits them as "
            f"{EXPERT_FORMAT}: add --experts {EXPERT_FORMAT} --as-job for the plan it runs")
    print(json.dumps(out, indent=2) if args.json else _table(out))
    return 0


def _pool_only(args: argparse.Namespace) -> int:
    if args.model_config is None or args.ctx is None:
        raise UsageError("without --config, pass --model-config FILE and --ctx N")
    fp = _footprint(args.model_config)
    _tier_fits(fp, args.kv)
    slots, tier = args.slots or 1, args.kv or "f32"
    out = {
        "model": str(args.model_config), "model_type": fp.config.model_type, "tier": tier, "ctx": args.ctx,
        "slots": slots, "cached_layers": fp.cached_layers,
        "kv_token_bytes": fp.kv_token_bytes(tier), "kv_bytes_per_token": fp.kv_bytes_per_token(tier),
        "kv_pool_bytes": fp.kv_pool_bytes(tier, slots, args.ctx),
        "indexer_layers": len(fp.indexer_layers), "index_bytes_per_token": fp.index_bytes_per_token,
        "index_pool_bytes": fp.index_pool_bytes(slots, args.ctx),
        "dense_bytes": fp.dense_bytes, "routed_experts": fp.run_experts,
        "mtp_experts": fp.routed_experts - fp.run_experts,
        # a tier the pool refuses at these widths (tq4 and polar need power-of-two ones) has
        # no sizes, only the reason
        "tiers": {t: {"kv_bytes_per_token": None, "kv_pool_bytes": None, "unavailable": why} if (
                      why := fp.tier_error(t)) else
                  {"kv_bytes_per_token": fp.kv_bytes_per_token(t), "kv_pool_bytes": fp.kv_pool_bytes(t, slots, args.ctx)}
                  for t in TIERS},
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{out['model_type']} ({out['model']}): {fp.cached_layers} cached layers, {slots} slot(s) x {args.ctx} tokens")
    print(f"{'tier':<8} {'bytes/token':>12} {'KV pool':>12}")
    for t, v in out["tiers"].items():
        mark = " <" if t == tier else ""
        if v["kv_pool_bytes"] is None:
            print(f"{t:<8} {'unavailable':>12} {'-':>12}")
        else:
            print(f"{t:<8} {v['kv_bytes_per_token']:>12} {size(v['kv_pool_bytes']):>12}{mark}")
    off = [t for t, v in out["tiers"].items() if v["kv_pool_bytes"] is None]
    if off:
        print(f"unavailable ({', '.join(off)}): they rotate rows, which needs power-of-two widths "
              f"2..2048; kv_lora_rank {fp.config.kv_lora_rank}, qk_rope_head_dim {fp.config.qk_rope_head_dim}")
    print(f"DSA indexer: {out['indexer_layers']} layers, {out['index_bytes_per_token']} B/token, "
          f"{size(out['index_pool_bytes'])} (not in the KV pool)")
    return 0


def size(n: int) -> str:
    """Bytes in the largest decimal unit (GB = 1e9, as everywhere here) that keeps the figure
    >= 1, so that a small pool (a tiny model's few MB) does not print as 0.0 GB."""
    for unit, scale in (("GB", GB), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _gb_cell(n: int) -> str:
    """A fleet-table cell in GB; a size that is not zero but rounds to 0.00 shows as <0.01."""
    return "<0.01" if 0 < n < GB // 200 else f"{n / GB:.2f}"


def _table(d: dict) -> str:
    g = _gb_cell
    lines = [
        f"model {d['model_type']} ({d['model']}): {d['cached_layers']} cached layers, "
        f"{d['moe_layers']} MoE layers, {d['routed_experts']} routed experts of {size(d['expert_bytes'])} "
        f"({d['expert_format']})" + (f" (+ {d['mtp_experts']} in MTP layers, which kvfleet does not load "
                                     f"or plan)" if d["mtp_experts"] else ""),
        f"KV {d['tier']} at {d['ctx']} tokens/slot: {d['kv_bytes_per_token']} B/token"
        + (f" ({d['kv_layers']} layers: a kvfleet job's pool caches no MTP layer)"
           if d["kv_layers"] != d["cached_layers"] else "")
        + f" + indexer {d['index_bytes_per_token']} B/token"
        + (" (a kvfleet job computes none)" if d.get("as_job") and d["index_bytes_per_token"] == 0 else "")
        + "; sizes in GB (1e9 bytes)",
        f"{'device':<22}{'kind':<6}{'slots':>5}{'budget':>9}{'dense':>8}{'kv':>8}{'index':>7}{'shadow':>7}"
        f"{'pinned':>8}{'pin GB':>8}{'free':>8}  max ctx (f32/kv8/tq4)",
    ]
    for v in d["devices"]:
        ctxs = "/".join(str(v["max_ctx"].get(t, "-")) for t in ("f32", "kv8", "tq4"))
        lines.append(
            f"{v['name']:<22}{v['kind']:<6}{v['slots']:>5}{g(v['budget_bytes']):>9}{g(v['dense_bytes']):>8}"
            f"{g(v['kv_pool_bytes']):>8}{g(v['index_bytes']):>7}{g(v['shadow_bytes']):>7}"
            f"{v['pinned_experts']:>8}{g(v['pinned_expert_bytes']):>8}{g(v['free_bytes']):>8}  {ctxs}")
    if any(v["kind"] == "cuda" for v in d["devices"]):
        lines.append(
            f"shadow: {d['shadow_tier']} rows of {d['kv_layers']} layers on cuda devices of at least "
            f"{size(d['shadow_floor_bytes'])} (the C engine's device copy of rows made on the host)"
            if d["shadow_tier"] else
            "shadow: none (a kvfleet cuda worker's KV pool is on the GPU and takes rows made on the "
            "host in once, when written: the kv column counts them)")
    how = "" if len(d["devices"]) < 2 else (
        "; dealt out evenly (an even share fits every device)" if d["experts_even"] else
        "; most room first (an even share does not fit every device)")
    lines.append(f"experts: {d['pinned_experts']} of {d['routed_experts']} pinned on devices, "
                 f"{d['host_experts']} served from host memory{how}")
    per = ", ".join(f"{v['name']} {size(v['host_bytes'])}" for v in d["devices"])
    lines.append(f"host memory of a kvfleet job: {size(d['host_bytes'])} of {d['host_dtype']} weights "
                 f"(its loader's dtype; routed experts on cpu and metal devices and those a cuda "
                 f"device does not pin, dense weights on cpu devices): {per}")
    if d.get("as_job"):
        lines.append(f"sized as kvfleet generate runs it (--as-job): cuda devices' dense weights "
                     f"and pinned experts as {d['host_dtype']}, what their workers upload")
    if d["measured_here"]:
        lines.append(f"free memory of 'auto' devices measured on this machine: {', '.join(d['measured_here'])}")
    lines += [f"warning: {w}" for w in d["warnings"]]
    return "\n".join(lines)
