"""The checkpoint name table and the loader: hub safetensors -> float32 model parameters.

`name_table(cfg)` is the one place that maps Hugging Face names of the DeepSeek-V3 family to
kvfleet parameter keys and shapes. Routed experts are stacked: checkpoint tensor
`model.layers.{i}.mlp.experts.{j}.gate_proj.weight` [I, H] is row j of parameter
`layers.{i}.experts.gate` [E, I, H].

Tensors the model does not use yet are recognized and logged once, never errors: the MTP
layers `model.layers.{n}.*` with num_hidden_layers <= n < num_hidden_layers +
num_nextn_predict_layers, and the DSA indexer `*.self_attn.indexer.*`.
Anything else that the table does not name is an error, as is a missing tensor or a shape
that differs from the config's.
"""
from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from workers.config import ModelConfig
from workers.safetensors_io import TensorRef, WeightsError, read_header

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
# The routed experts this loader reads, as cluster.footprint sizes them: the bf16 checkpoint.
# It reads bf16 / fp16 / f32 tensors only (no packed int4 or block-scaled fp8 experts), so a
# job plans and splits its experts as bf16 whatever a fleet's plan.experts says.
EXPERT_FORMAT = "bf16"
SINGLE_FILE = "model.safetensors"
# What load_params returns, whatever the checkpoint holds: a bf16 checkpoint takes twice its
# file bytes in host memory (and on the device, where a model uploads these arrays as is).
PARAM_DTYPE = np.float32


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor goes."""
    param: str  # kvfleet parameter key, e.g. "layers.3.experts.gate"
    shape: tuple[int, ...]  # shape of the checkpoint tensor
    index: int | None = None  # row of a stacked [E, ...] parameter (routed expert j)
    stack: int = 0  # E for stacked parameters


def name_table(cfg: ModelConfig) -> dict[str, Slot]:
    """Every tensor the model needs: hub name -> Slot."""
    H, nh, V = cfg.hidden_size, cfg.num_attention_heads, cfg.vocab_size
    qk, kvr, rope = cfg.qk_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    t: dict[str, Slot] = {
        "model.embed_tokens.weight": Slot("embed", (V, H)),
        "model.norm.weight": Slot("norm", (H,)),
    }
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = Slot("lm_head", (V, H))
    for i in range(cfg.num_hidden_layers):
        hub, key = f"model.layers.{i}.", f"layers.{i}."
        a = hub + "self_attn."
        t[hub + "input_layernorm.weight"] = Slot(key + "attn_norm", (H,))
        t[hub + "post_attention_layernorm.weight"] = Slot(key + "mlp_norm", (H,))
        if cfg.q_lora_rank is None:
            t[a + "q_proj.weight"] = Slot(key + "q", (nh * qk, H))
        else:
            r = cfg.q_lora_rank
            t[a + "q_a_proj.weight"] = Slot(key + "q_a", (r, H))
            t[a + "q_a_layernorm.weight"] = Slot(key + "q_a_norm", (r,))
            t[a + "q_b_proj.weight"] = Slot(key + "q_b", (nh * qk, r))
            if cfg.attention_bias:
                t[a + "q_a_proj.bias"] = Slot(key + "q_a_bias", (r,))
        t[a + "kv_a_proj_with_mqa.weight"] = Slot(key + "kv_a", (kvr + rope, H))
        t[a + "kv_a_layernorm.weight"] = Slot(key + "kv_a_norm", (kvr,))
        t[a + "kv_b_proj.weight"] = Slot(key + "kv_b", (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), kvr))
        t[a + "o_proj.weight"] = Slot(key + "o", (H, nh * cfg.v_head_dim))
        if cfg.attention_bias:
            t[a + "kv_a_proj_with_mqa.bias"] = Slot(key + "kv_a_bias", (kvr + rope,))
            t[a + "o_proj.bias"] = Slot(key + "o_bias", (H,))
        m = hub + "mlp."
        if not cfg.is_moe_layer(i):
            inter = cfg.intermediate_size
            for p in ("gate", "up"):
                t[m + f"{p}_proj.weight"] = Slot(key + p, (inter, H))
            t[m + "down_proj.weight"] = Slot(key + "down", (H, inter))
            continue
        E, mi = cfg.n_routed_experts, cfg.moe_intermediate_size
        t[m + "gate.weight"] = Slot(key + "router", (E, H))
        if cfg.topk_method == "noaux_tc":
            t[m + "gate.e_score_correction_bias"] = Slot(key + "router_bias", (E,))
        for j in range(E):
            e = m + f"experts.{j}."
            t[e + "gate_proj.weight"] = Slot(key + "experts.gate", (mi, H), j, E)
            t[e + "up_proj.weight"] = Slot(key + "experts.up", (mi, H), j, E)
            t[e + "down_proj.weight"] = Slot(key + "experts.down", (H, mi), j, E)
        if cfg.n_shared_experts:
            si = mi * cfg.n_shared_experts
            t[m + "shared_experts.gate_proj.weight"] = Slot(key + "shared.gate", (si, H))
            t[m + "shared_experts.up_proj.weight"] = Slot(key + "shared.up", (si, H))
            t[m + "shared_experts.down_proj.weight"] = Slot(key + "shared.down", (H, si))
    return t


def loaded_bytes(cfg: ModelConfig) -> tuple[int, int]:
    """(dense, one routed expert): bytes of the arrays load_params returns for `cfg`, in
    PARAM_DTYPE. dense = every parameter but the routed experts (no MTP or indexer tensors:
    they are not loaded); one routed expert = its gate [I, H], up [I, H] and down [H, I]."""
    size = np.dtype(PARAM_DTYPE).itemsize
    dense = sum(math.prod(s.shape) for s in name_table(cfg).values() if s.index is None)
    return dense * size, 3 * cfg.moe_intermediate_size * cfg.hidden_size * size


def _layer(name: str) -> int | None:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return None if m is None else int(m.group(1))


def _ignored_kind(name: str, cfg: ModelConfig) -> str | None:
    """'mtp' / 'dsa indexer' / ... for tensors recognized but not used, else None."""
    n = _layer(name)
    if n is not None and n >= cfg.num_hidden_layers:  # beyond the MTP layers: unknown, never dropped
        return "mtp" if n < cfg.num_hidden_layers + cfg.num_nextn_predict_layers else None
    if ".self_attn.indexer." in name:
        return "dsa indexer"
    if name.endswith("rotary_emb.inv_freq"):
        return "rotary buffer"
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return "tied lm_head"
    return None


def open_checkpoint(model_dir: str | Path) -> dict[str, TensorRef]:
    """All tensors of a checkpoint dir (sharded via the index file, or one model.safetensors)."""
    d = Path(model_dir)
    index = d / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise WeightsError(f"{index}: not a safetensors index with a weight_map ({e!r})") from None
        if not isinstance(weight_map, dict):
            raise WeightsError(f"{index}: weight_map must be an object {{tensor name: shard file}}, "
                               f"got {type(weight_map).__name__}")
        for name, fname in weight_map.items():
            if not isinstance(fname, str):
                raise WeightsError(f"{index}: maps {name!r} to {fname!r}, which is not a shard file name")
        files = sorted(set(weight_map.values()))
    elif (d / SINGLE_FILE).exists():
        weight_map, files = None, [SINGLE_FILE]
    else:
        raise WeightsError(f"{d}: no {SINGLE_FILE} or {INDEX_FILE}")
    refs: dict[str, TensorRef] = {}
    for fname in files:
        path = d / fname
        if not path.exists():
            raise WeightsError(f"{index}: lists shard {fname!r}, which does not exist")
        for name, ref in read_header(path).items():
            if name in refs:
                raise WeightsError(f"{path}: tensor {name!r} also in {refs[name].file}")
            refs[name] = ref
    if weight_map is not None:
        for name, fname in weight_map.items():
            if name not in refs or refs[name].file != d / fname:
                raise WeightsError(f"{index}: maps {name!r} to {fname!r}, which does not hold it")
    return refs


def check_checkpoint(model_dir: str | Path, cfg: ModelConfig
                     ) -> tuple[dict[str, TensorRef], dict, dict[str, int]]:
    """(tensors, name table, {kind: tensors recognized and not used}) of a checkpoint whose
    headers name every tensor `cfg` needs, at its shape, and no unknown one; WeightsError
    naming the file otherwise. Reads no tensor data (a job checks its model with it before
    any worker starts)."""
    refs = open_checkpoint(model_dir)
    table = name_table(cfg)
    ignored: dict[str, int] = {}
    for name, ref in refs.items():
        if name in table:
            continue
        kind = _ignored_kind(name, cfg)
        if kind is None:
            hint = " (fp8 block-scaled checkpoints are not supported)" if "scale" in name else ""
            if (layer := _layer(name)) is not None and layer >= cfg.num_hidden_layers:
                hint = (f" (layer {layer} is past num_hidden_layers={cfg.num_hidden_layers} + "
                        f"num_nextn_predict_layers={cfg.num_nextn_predict_layers} of {cfg.source})")
            raise WeightsError(f"{ref.file}: unknown tensor {name!r} {list(ref.shape)}{hint}")
        ignored[kind] = ignored.get(kind, 0) + 1
    missing = [f"{n!r} {list(s.shape)}" for n, s in table.items() if n not in refs]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise WeightsError(f"{model_dir}: missing tensor {', '.join(missing[:3])}{more}")
    for name, slot in table.items():
        ref = refs[name]
        if ref.shape != slot.shape:
            raise WeightsError(f"{ref.file}: tensor {name!r} has shape {list(ref.shape)}, "
                               f"expected {list(slot.shape)} from {cfg.source}")
    return refs, table, ignored


def load_params(model_dir: str | Path, cfg: ModelConfig,
                experts: dict[int, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Check every tensor's presence and shape against the name table (check_checkpoint),
    then read them as f32.

    experts: {MoE layer: routed expert ids} = read only those experts (an expert-parallel
    shard): `layers.{i}.experts.*` then stack the listed ids in that order, [len(ids), ...];
    the others are checked but never read. None = every expert."""
    refs, table, ignored = check_checkpoint(model_dir, cfg)
    for kind, n in ignored.items():
        log.info("%s: %d %s tensors recognized and not used", model_dir, n, kind)
    for i, ids in (experts or {}).items():  # (a bad id left an np.empty row of the stack)
        ids = np.asarray(ids).reshape(-1)
        bad = [int(j) for j in ids if not 0 <= int(j) < cfg.n_routed_experts]
        if (bad or len(set(ids.tolist())) != len(ids) or (ids.size and ids.dtype.kind not in "iu")
                or not 0 <= int(i) < cfg.num_hidden_layers or not cfg.is_moe_layer(int(i))):
            raise ValueError(f"experts[{i}] = {ids.tolist()[:8]}: needs a MoE layer of "
                             f"{cfg.source} and distinct integer expert ids in "
                             f"[0, {cfg.n_routed_experts})")
    rows = None if experts is None else {  # layer -> {expert id: row in the shard's stack}
        int(i): {int(j): r for r, j in enumerate(np.asarray(ids).tolist())} for i, ids in experts.items()}
    params: dict[str, np.ndarray] = {}
    for name, slot in table.items():
        if slot.index is None:
            params[slot.param] = refs[name].read()
            continue
        row, stack = slot.index, slot.stack
        if rows is not None:
            mine = rows.get(int(slot.param.split(".")[1]), {})
            if slot.index not in mine:
                continue
            row, stack = mine[slot.index], len(mine)
        if slot.param not in params:
            params[slot.param] = np.empty((stack, *slot.shape), PARAM_DTYPE)
        params[slot.param][row] = refs[name].read()
    return params
