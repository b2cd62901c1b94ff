"""Make a deterministic tiny random checkpoint in the Hugging Face hub format.

    python scripts/make_tiny_model.py DIR [--seed N] [--variant NAME ...]

Writes config.json (model_type deepseek_v3), model.safetensors (bf16 by default) or shards
with model.safetensors.index.json, tokenizer.json (a small byte-level BPE trained on fixed
text) and generation_config.json. Latent widths are GLM-5's (kv_lora_rank 512,
qk_rope_head_dim 64); everything else is small. Same seed and variants -> same bytes.

Variants (combine freely): no_q_lora, softmax, softmax_grouped, yarn, tied, multi_eos,
half_rope (rope_interleave false), sharded, f32 (weights stored as float32), glm
(model_type glm_moe_dsa with mlp_layer_types, a large rms_norm_eps, DSA index_* keys).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from workers.config import ModelConfig  # noqa: E402
from workers.safetensors_io import save_file  # noqa: E402
from workers.weights import name_table  # noqa: E402

VARIANTS = ("no_q_lora", "softmax", "softmax_grouped", "yarn", "tied", "multi_eos",
            "half_rope", "sharded", "f32", "glm")
SPECIALS = ["<|bos|>", "<|eos|>", "<|eot|>", "<|user|>", "<|assistant|>"]
VOCAB = 512

CORPUS = """\
Large language models with multi-head latent attention keep one small latent row per token
and layer instead of full keys and values. A mixture of experts sends every token to a few
experts chosen by a router, while a shared expert sees every token. The key cache can be
stored in eight-bit floating point or in four-bit rotated codes, so that long contexts fit.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Once upon a time there was a small model that could count: one, two, three, four, five,
six, seven, eight, nine, ten. It liked numbers such as 3.14159, 2.71828 and 1024.
Question: what is the capital of France? Answer: Paris. Question: how many legs has a spider?
Answer: eight. The cluster schedules requests, decodes many slots at once and saves caches.
"""


def base_config(variants: set[str]) -> dict:
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
        "q_lora_rank": 32, "qk_rope_head_dim": 64, "qk_nope_head_dim": 16, "v_head_dim": 16,
        "n_group": 2, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "norm_topk_prob": True,
        "hidden_act": "silu", "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "rope_scaling": None, "rope_interleave": True,
        "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 0,
        "eos_token_id": 1, "num_nextn_predict_layers": 0, "torch_dtype": "bfloat16",
    }
    if "no_q_lora" in variants:
        cfg["q_lora_rank"] = None
    if "softmax" in variants or "softmax_grouped" in variants:
        cfg.update(scoring_func="softmax", topk_method="greedy", norm_topk_prob=False,
                   routed_scaling_factor=1.0, n_group=1, topk_group=1)
    if "softmax_grouped" in variants:
        cfg.update(topk_method="group_limited_greedy", n_group=4, topk_group=2, norm_topk_prob=True)
    if "yarn" in variants:
        cfg["max_position_embeddings"] = 256
        cfg["rope_scaling"] = {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                               "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.7}
    if "tied" in variants:
        cfg["tie_word_embeddings"] = True
    if "multi_eos" in variants:
        cfg["eos_token_id"] = [1, 2]
    if "half_rope" in variants:
        cfg["rope_interleave"] = False
    if "glm" in variants:
        cfg.update(model_type="glm_moe_dsa", architectures=["GlmMoeDsaForCausalLM"], rms_norm_eps=0.05,
                   mlp_layer_types=["dense", "sparse", "dense"], first_k_dense_replace=None,
                   n_group=1, topk_group=1, index_n_heads=4, index_head_dim=32, index_topk=2048)
    if "f32" in variants:
        cfg["torch_dtype"] = "float32"
    return cfg


def random_tensors(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Scaled Gaussian weights: 1/sqrt(fan_in) matrices, norms near 1, a non-zero router bias."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, slot in name_table(cfg).items():
        shape = slot.shape
        if len(shape) == 2:
            std = 1.0 if name == "model.embed_tokens.weight" else shape[1] ** -0.5
            out[name] = rng.normal(0.0, std, shape)
        elif name.endswith("e_score_correction_bias"):
            out[name] = rng.normal(0.0, 0.1, shape)
        else:  # norm weights and biases
            out[name] = (0.0 if name.endswith(".bias") else 1.0) + rng.normal(0.0, 0.1, shape)
    return {k: v.astype(np.float32) for k, v in out.items()}


def train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS.splitlines() * 4, trainer)
    return tok


def make_tiny_model(out_dir: str | Path, seed: int = 0, variants: tuple[str, ...] = ()) -> Path:
    bad = set(variants) - set(VARIANTS)
    if bad:
        raise ValueError(f"unknown variants {sorted(bad)}; known: {VARIANTS}")
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    raw = base_config(set(variants))
    tok = train_tokenizer()
    if tok.get_vocab_size() > VOCAB:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens > vocab {VOCAB}")
    (d / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    cfg = ModelConfig.from_file(d / "config.json")
    tensors = random_tensors(cfg, seed)
    dtype = "F32" if "f32" in variants else "BF16"
    if "sharded" in variants:
        names = list(tensors)
        shards = [names[: len(names) // 2], names[len(names) // 2:]]
        weight_map = {}
        for k, part in enumerate(shards):
            fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(d / fname, {n: tensors[n] for n in part}, dtype)
            weight_map.update({n: fname for n in part})
        index = {"metadata": {"total_size": sum(t.size * (4 if dtype == "F32" else 2) for t in tensors.values())},
                 "weight_map": weight_map}
        (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    else:
        save_file(d / "model.safetensors", tensors, dtype)
    tok.save(str(d / "tokenizer.json"))
    gen = {"bos_token_id": raw["bos_token_id"], "eos_token_id": raw["eos_token_id"],
           "do_sample": True, "temperature": 0.7, "top_p": 0.95}
    (d / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return d


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variant", action="append", default=[], choices=VARIANTS,
                    help="may be repeated")
    args = ap.parse_args(argv)
    d = make_tiny_model(args.dir, args.seed, tuple(args.variant))
    print(f"wrote {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
