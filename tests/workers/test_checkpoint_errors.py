"""Bad checkpoints and configs give one clear error naming the thing; good variants load."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from workers.config import ConfigError, ModelConfig
from workers.model import Model
from workers.safetensors_io import WeightsError, read_header, save_file
from workers.weights import load_params, name_table, open_checkpoint


@pytest.fixture
def ckpt(tiny, tmp_path):
    """A writable copy of the f32 tiny checkpoint and its tensors."""
    d = tmp_path / "m"
    shutil.copytree(tiny("f32"), d)
    refs = open_checkpoint(d)
    return d, {n: r.read() for n, r in refs.items()}


def test_missing_tensor_names_it_and_its_shape(ckpt):
    d, t = ckpt
    del t["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(d / "model.safetensors", t, "F32")
    with pytest.raises(WeightsError, match=r"missing tensor 'model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight' \[32, 64\]"):
        Model.load(d)


def test_wrong_shape_names_tensor_and_both_shapes(ckpt):
    d, t = ckpt
    t["model.layers.0.self_attn.kv_b_proj.weight"] = t["model.layers.0.self_attn.kv_b_proj.weight"][:-1]
    save_file(d / "model.safetensors", t, "F32")
    with pytest.raises(WeightsError, match=r"'model\.layers\.0\.self_attn\.kv_b_proj\.weight' has shape \[127, 512\], expected \[128, 512\]"):
        Model.load(d)


def test_unknown_tensor_is_an_error(ckpt):
    d, t = ckpt
    t["model.layers.0.self_attn.mystery.weight"] = np.ones(3, np.float32)
    save_file(d / "model.safetensors", t, "F32")
    with pytest.raises(WeightsError, match=r"unknown tensor 'model\.layers\.0\.self_attn\.mystery\.weight'"):
        Model.load(d)


def _set_config(d, **fields):
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **fields}))


def test_mtp_and_indexer_tensors_are_recognized_not_errors(ckpt, caplog):
    d, t = ckpt
    _set_config(d, num_nextn_predict_layers=1)
    t["model.layers.3.eh_proj.weight"] = np.ones((4, 4), np.float32)  # MTP layer (layers = 3)
    t["model.layers.3.enorm.weight"] = np.ones(4, np.float32)
    t["model.layers.1.self_attn.indexer.wk.weight"] = np.ones((4, 4), np.float32)
    save_file(d / "model.safetensors", t, "F32")
    with caplog.at_level("INFO"):
        Model.load(d)
    assert "2 mtp tensors" in caplog.text and "1 dsa indexer tensors" in caplog.text


def test_layers_past_the_config_are_unknown_not_mtp(ckpt):
    """A checkpoint with more layers than config.json says must not load truncated."""
    d, t = ckpt
    _set_config(d, num_hidden_layers=2)  # the checkpoint has 3 layers, no MTP layer
    with pytest.raises(WeightsError, match=r"unknown tensor 'model\.layers\.2\..*' .*layer 2 is past "
                                           r"num_hidden_layers=2 \+ num_nextn_predict_layers=0 of .*config\.json"):
        Model.load(d)
    _set_config(d, num_hidden_layers=3, num_nextn_predict_layers=1)
    t["model.layers.3.eh_proj.weight"] = np.ones((4, 4), np.float32)  # the one MTP layer
    t["model.layers.4.eh_proj.weight"] = np.ones((4, 4), np.float32)  # one past it
    save_file(d / "model.safetensors", t, "F32")
    with pytest.raises(WeightsError, match=r"unknown tensor 'model\.layers\.4\.eh_proj\.weight' \[4, 4\]"):
        Model.load(d)


def test_truncated_safetensors_names_the_file(ckpt):
    d, _ = ckpt
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-100])
    with pytest.raises(WeightsError, match=r"model\.safetensors: truncated safetensors file: tensor '.*' ends at byte"):
        Model.load(d)
    f.write_bytes(data[:20])
    with pytest.raises(WeightsError, match="truncated"):
        read_header(f)


def _raw_safetensors(path, header: dict, data: bytes):
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


def _f32(shape, begin, end):
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


@pytest.mark.parametrize("header,match", [
    ({"a": _f32([4], 0, 16), "b": _f32([2], 4, 12)}, r"tensor 'b' data_offsets \[4, 12\] overlap tensor 'a'"),
    ({"a": _f32([2], 0, 8), "b": _f32([2], 4, 12), "c": _f32([1], 12, 16)}, r"tensor 'b' .* overlap tensor 'a'"),
    ({"a": _f32([2], 8, 16)}, r"tensor 'a' starts at data offset 8, leaving a gap of 8 bytes"),
    ({"a": _f32([1], 0, 4), "b": _f32([2], 8, 16)}, r"tensor 'b' .* gap of 4 bytes after tensor 'a'"),
    ({"a": _f32([3], 0, 12)}, r"4 unused bytes after the last tensor 'a'"),
    ({"__metadata__": {"format": "pt"}}, r"16 unused bytes after no tensor"),
    ({"a": _f32([-2, -2], 0, 16)}, r"tensor 'a' needs shape and data_offsets .* shape=\[-2, -2\]"),
    ({"a": _f32([4.7], 0, 16)}, r"tensor 'a' needs .* shape=\[4\.7\]"),
    ({"a": _f32([4.0], 0, 16)}, r"tensor 'a' needs .* shape=\[4\.0\]"),
    ({"a": _f32([True, 4], 0, 16)}, r"tensor 'a' needs .* shape=\[True, 4\]"),
    ({"a": _f32("4", 0, 16)}, r"tensor 'a' needs .* shape='4'"),
    ({"a": _f32([4], "0", "16")}, r"tensor 'a' needs .* data_offsets=\['0', '16'\]"),
    ({"a": _f32([4], 0.0, 16.0)}, r"tensor 'a' needs .* data_offsets=\[0\.0, 16\.0\]"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16, 5]}},
     r"tensor 'a' needs .* data_offsets=\[0, 16, 5\]"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": 16}}, r"tensor 'a' needs .* data_offsets=16"),
    ({"a": _f32([4], 16, 0)}, r"tensor 'a' F32\[4\] needs 16 bytes, header gives data_offsets \[16, 0\]"),
    ({"a": {"dtype": ["F32"], "shape": [4], "data_offsets": [0, 16]}}, r"tensor 'a' has dtype \['F32'\]"),
    ({"a": "oops"}, r"tensor 'a' has a malformed header entry 'oops'"),
])
def test_corrupt_safetensors_header_is_a_weights_error(tmp_path, header, match):
    """What the reference safetensors library rejects is a WeightsError naming file and tensor."""
    f = _raw_safetensors(tmp_path / "bad.safetensors", header, np.arange(4, dtype=np.float32).tobytes())
    with pytest.raises(WeightsError, match=match) as e:
        read_header(f)
    assert str(e.value).startswith(f"{f}: ")


def test_safetensors_header_in_any_order_and_empty_tensors_load(tmp_path):
    data = np.arange(4, dtype=np.float32).tobytes()
    header = {"b": _f32([2], 8, 16), "z": _f32([0, 3], 16, 16), "e": _f32([0], 0, 0), "a": _f32([1, 2], 0, 8)}
    refs = read_header(_raw_safetensors(tmp_path / "ok.safetensors", header, data))
    assert refs["a"].read().tolist() == [[0.0, 1.0]] and refs["b"].read().tolist() == [2.0, 3.0]
    assert refs["z"].read().shape == (0, 3) and refs["e"].read().shape == (0,)
    assert read_header(_raw_safetensors(tmp_path / "none.safetensors", {"__metadata__": {}}, b"")) == {}


def test_shipped_model_header_is_valid():
    refs = read_header(Path(__file__).parents[2] / "models" / "kvfleet-mini" / "model.safetensors")
    assert "model.embed_tokens.weight" in refs


def test_missing_shard_and_missing_weights(tiny, tmp_path):
    d = tmp_path / "s"
    shutil.copytree(tiny("sharded"), d)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightsError, match="model-00002-of-00002.safetensors"):
        Model.load(d)
    (d / "model.safetensors.index.json").unlink()
    with pytest.raises(WeightsError, match="no model.safetensors"):
        Model.load(d)


@pytest.mark.parametrize("prefix", ["w/", "./"])
def test_index_shard_paths_relative_to_the_dir_load(tiny, tmp_path, prefix):
    """weight_map values are paths relative to the dir (transformers joins them to it); a shard
    in a subfolder or spelled './x' was refused: 'maps ... to 'w/x', which does not hold it'."""
    d = tmp_path / "s"
    shutil.copytree(tiny("sharded"), d)
    index = d / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    (d / "w").mkdir()
    for f in set(raw["weight_map"].values()):
        (d / f).rename(d / prefix / f)
    index.write_text(json.dumps({**raw, "weight_map": {n: prefix + f for n, f in raw["weight_map"].items()}}))
    refs = open_checkpoint(d)
    want = open_checkpoint(tiny("sharded"))
    assert set(refs) == set(want)
    np.testing.assert_array_equal(refs["model.norm.weight"].read(), want["model.norm.weight"].read())


@pytest.mark.parametrize("weight_map,match", [
    (["model-00001-of-00002.safetensors"], r"weight_map must be an object \{tensor name: shard file\}, got list"),
    ("model-00001-of-00002.safetensors", r"weight_map must be an object .*, got str"),
    ({"model.norm.weight": None}, r"maps 'model\.norm\.weight' to None, which is not a shard file name"),
    ({"model.norm.weight": 3}, r"maps 'model\.norm\.weight' to 3, which is not a shard file name"),
    (None, r"not a safetensors index with a weight_map \(UnicodeDecodeError"),  # bytes that are not UTF-8
])
def test_malformed_index_is_a_weights_error(tiny, tmp_path, weight_map, match):
    """A weight_map that is not {name: file} was an AttributeError / TypeError naming no file."""
    d = tmp_path / "s"
    shutil.copytree(tiny("sharded"), d)
    index = d / "model.safetensors.index.json"
    if weight_map is None:
        index.write_bytes(b'{"weight_map": {"model.norm.weight": "\xff\xfe"}}')
    else:
        index.write_text(json.dumps({**json.loads(index.read_text()), "weight_map": weight_map}))
    with pytest.raises(WeightsError, match=match) as e:
        Model.load(d)
    assert str(e.value).startswith(f"{index}: ")


@pytest.mark.parametrize("field,value,match", [
    ("num_attention_heads", 0, "num_attention_heads=0 must be >= 1"),
    ("num_experts_per_tok", 9, "num_experts_per_tok=9 exceeds n_routed_experts=8"),
    ("topk_group", 3, "topk_group=3 exceeds n_group=2"),
    ("n_group", 3, "n_routed_experts=8 is not divisible by n_group=3"),
    ("scoring_func", "relu", "scoring_func='relu' must be one of"),
    ("kv_lora_rank", "512", "kv_lora_rank='512' must be an integer"),
    ("rope_scaling", {"type": "dynamic", "factor": 2}, "rope_type='dynamic' is not supported"),
    ("rope_parameters", "yarn", "rope_parameters='yarn' must be an object or null"),  # was ignored
    ("model_type", ["deepseek_v3"], r"model_type=\['deepseek_v3'\] must be a string"),  # was a TypeError
    ("rope_interleave", "false", "rope_interleave='false' must be true or false"),  # bool('false') was True
    ("norm_topk_prob", "false", "norm_topk_prob='false' must be true or false"),
    ("rope_scaling", {"type": "yarn", "factor": 4, "original_max_position_embeddings": 128, "truncate": "false"},
     "rope_scaling: truncate='false' must be true or false"),
    ("rope_parameters", [{"rope_type": "yarn", "factor": 40}], "rope_parameters=.* must be an object or null"),
    ("mlp_layer_types", ["dense", "moe", "sparse"], "mlp_layer_types=.* must list 'dense' or 'sparse'"),
])
def test_bad_config_value_names_field_and_file(tiny, tmp_path, field, value, match):
    d = tmp_path / "c"
    shutil.copytree(tiny(), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg[field] = value
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=match) as e:
        Model.load(d)
    assert str(d / "config.json") in str(e.value)


def test_missing_required_config_field(tiny, tmp_path):
    raw = json.loads((tiny() / "config.json").read_text())
    del raw["kv_lora_rank"]
    with pytest.raises(ConfigError, match="x.json: missing required field 'kv_lora_rank'"):
        ModelConfig.from_dict(raw, source="x.json")


def test_config_that_is_not_utf8_names_the_file(tmp_path):
    """Bytes that are not UTF-8 were a bare UnicodeDecodeError naming no file."""
    (tmp_path / "config.json").write_bytes(b'{"model_type": "\xff\xfe"}')
    with pytest.raises(ConfigError, match=r"config\.json: not valid JSON \(.*can't decode byte 0xff"):
        ModelConfig.from_file(tmp_path)


@pytest.mark.parametrize("fields,match", [
    ({"rope_scaling": {"type": "yarn", "original_max_position_embeddings": "4096"}},
     r"x\.json rope_scaling: original_max_position_embeddings='4096' must be an integer"),
    ({"max_position_embeddings": "163840", "rope_scaling": {"type": "yarn", "original_max_position_embeddings": 4096}},
     r"x\.json: max_position_embeddings='163840' must be an integer"),
])
def test_yarn_factor_derived_from_bad_fields_names_them(tiny, fields, match):
    """A yarn block without factor derives it from max_position_embeddings / original_...: a bad
    original_... was reported as 'factor=None must be a finite number', a bad
    max_position_embeddings was a TypeError."""
    raw = json.loads((tiny() / "config.json").read_text())
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict({**raw, **fields}, source="x.json")


def test_rope_parameters_form_equals_hub_form(tiny):
    raw = json.loads((tiny("yarn") / "config.json").read_text())
    hub = ModelConfig.from_dict(raw)
    v5 = dict(raw)
    v5["rope_parameters"] = {"rope_type": "yarn", "rope_theta": raw["rope_theta"], **raw["rope_scaling"]}
    del v5["rope_scaling"], v5["rope_theta"]
    assert ModelConfig.from_dict(v5) == hub
    assert hub.rope_scaling.factor == 8.0 and hub.rope_scaling.mscale_all_dim == 0.7


def test_family_defaults_and_unknown_keys(tiny):
    raw = json.loads((tiny() / "config.json").read_text())
    for k in ("scoring_func", "topk_method", "routed_scaling_factor", "norm_topk_prob"):
        del raw[k]
    raw["some_future_key"] = {"x": 1}
    v3 = ModelConfig.from_dict({**raw, "model_type": "deepseek_v3"})
    assert (v3.scoring_func, v3.topk_method, v3.routed_scaling_factor) == ("sigmoid", "noaux_tc", 2.5)
    v2 = ModelConfig.from_dict({**raw, "model_type": "deepseek_v2", "n_group": 1, "topk_group": 1})
    assert (v2.scoring_func, v2.topk_method, v2.norm_topk_prob) == ("softmax", "greedy", False)
    assert ModelConfig.from_dict({**raw, "eos_token_id": [1, 2]}).eos_token_ids == (1, 2)
    # keys left out read as transformers' DeepseekV3Config has them (were 1 / 1 / 0 / None,
    # another model than transformers builds); null shared experts are none (DeepseekV2)
    bare = {k: v for k, v in raw.items()
            if k not in ("q_lora_rank", "n_group", "topk_group", "first_k_dense_replace")}
    v3 = ModelConfig.from_dict({**bare, "model_type": "deepseek_v3", "n_routed_experts": 64})
    assert (v3.q_lora_rank, v3.n_group, v3.topk_group, v3.first_k_dense_replace) == (1536, 8, 4, 3)
    assert ModelConfig.from_dict({**raw, "q_lora_rank": None}).q_lora_rank is None
    assert ModelConfig.from_dict({**raw, "n_shared_experts": None}).n_shared_experts == 0


def test_glm_layer_schedule_and_indexer_keys(tiny):
    cfg = ModelConfig.from_file(tiny("glm"))
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, False]
    assert (cfg.model_type, cfg.index_n_heads, cfg.index_topk, cfg.rms_norm_eps) == ("glm_moe_dsa", 4, 2048, 0.05)


def test_bf16_storage_reads_exactly(tmp_path):
    x = np.array([[1.0, -2.5, 3.140625, 1e-3], [65504.0, -0.0, 7.0, 1 / 3]], np.float32)
    save_file(tmp_path / "a.safetensors", {"w": x}, "BF16")
    got = read_header(tmp_path / "a.safetensors")["w"].read()
    import ml_dtypes
    np.testing.assert_array_equal(got, x.astype(ml_dtypes.bfloat16).astype(np.float32))
    save_file(tmp_path / "b.safetensors", {"w": x}, "F16")
    np.testing.assert_array_equal(read_header(tmp_path / "b.safetensors")["w"].read(), x.astype(np.float16).astype(np.float32))


def test_name_table_covers_checkpoint(tiny):
    d = tiny()
    cfg = ModelConfig.from_file(d / "config.json")
    assert set(name_table(cfg)) == set(open_checkpoint(d))
    p = load_params(d, cfg)
    assert p["layers.1.experts.gate"].shape == (8, 32, 64)
    assert "layers.0.gate" in p and "layers.0.router" not in p


def test_tiny_model_is_deterministic(maker, tmp_path):
    a = maker.make_tiny_model(tmp_path / "a", 7)
    b = maker.make_tiny_model(tmp_path / "b", 7)
    for f in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


# What transformers 5.24's config classes hold for the keys our ModelConfig reads, where a
# config.json leaves them out. kimi_k2 has no class of its own: the hub's config.json maps
# AutoConfig to its DeepseekV3Config and transformers' Kimi_K25Config reads a kimi_k2 text
# config as deepseek_v3. (bos/eos, not listed, stay unset: see FAMILY in workers/config.py.)
DEEPSEEK_V3_DEFAULTS = dict(
    q_lora_rank=1536, n_shared_experts=1, routed_scaling_factor=2.5, n_group=8, topk_group=4,
    first_k_dense_replace=3, norm_topk_prob=True, max_position_embeddings=4096,
    rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0, rope_interleave=True,
    attention_bias=False, index_n_heads=0, index_head_dim=0, index_topk=0)
HF_DEFAULTS = {
    "deepseek_v3": DEEPSEEK_V3_DEFAULTS,
    "kimi_k2": DEEPSEEK_V3_DEFAULTS,
    # GlmMoeDsaConfig; its attention always applies interleaved RoPE (no rope_interleave key)
    "glm_moe_dsa": dict(
        q_lora_rank=2048, n_shared_experts=1, routed_scaling_factor=2.5, n_group=1,
        topk_group=1, first_k_dense_replace=3, norm_topk_prob=True,
        max_position_embeddings=202752, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_theta=10000.0, rope_interleave=True, attention_bias=False, index_n_heads=32,
        index_head_dim=128, index_topk=2048),
}


@pytest.mark.parametrize("model_type", sorted(HF_DEFAULTS))
def test_left_out_keys_read_as_the_transformers_config_class_has_them(model_type):
    """A config.json with only the required keys gives the model transformers builds from
    it (kimi_k2 and glm_moe_dsa took COMMON's q_lora_rank None, first_k_dense_replace 0,
    n_group 1, rms_norm_eps 1e-6, max_position_embeddings 4096 and no DSA indexer)."""
    from workers.config import REQUIRED
    raw = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
               kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
               intermediate_size=128, n_routed_experts=16, num_experts_per_tok=4,
               moe_intermediate_size=32, model_type=model_type)
    assert set(raw) - {"model_type"} == set(REQUIRED)
    cfg = ModelConfig.from_dict(raw)
    got = {k: getattr(cfg, k) for k in HF_DEFAULTS[model_type]}
    assert got == HF_DEFAULTS[model_type]
    assert cfg.rope_scaling is None
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False] * 3 + [True] * 3


@pytest.mark.parametrize("model_type", sorted(HF_DEFAULTS))
def test_fewer_layers_than_the_default_first_k_dense_replace_are_all_dense(model_type):
    """Two layers and no first_k_dense_replace: the family default 3 was a ConfigError about
    a key the config never wrote; transformers builds every layer dense (layer_idx >= 3 is
    never true). An explicit value past the last layer stays an error naming it."""
    raw = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
               intermediate_size=128, n_routed_experts=16, num_experts_per_tok=4,
               moe_intermediate_size=32, model_type=model_type)
    cfg = ModelConfig.from_dict(raw, source="x.json")
    assert cfg.first_k_dense_replace == 2 and [cfg.is_moe_layer(i) for i in range(2)] == [False, False]
    assert ModelConfig.from_dict({**raw, "first_k_dense_replace": None}) == ModelConfig.from_dict(raw)
    assert ModelConfig.from_dict({**raw, "num_hidden_layers": 4}).first_k_dense_replace == 3
    with pytest.raises(ConfigError, match=r"x\.json: first_k_dense_replace=3 exceeds num_hidden_layers=2"):
        ModelConfig.from_dict({**raw, "first_k_dense_replace": 3}, source="x.json")
