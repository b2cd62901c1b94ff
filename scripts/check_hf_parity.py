"""Check kvfleet's numpy model against the `transformers` DeepseekV3 implementation.

    python scripts/check_hf_parity.py [--variant base|yarn|...|v2_grouped ...] [--tokens N]

Builds a small DeepseekV3ForCausalLM (GLM-5 latent widths: kv_lora_rank 512, rope 64),
re-initializes its weights with unit-scale values (the library's 0.02 init makes logits
nearly constant), saves it with save_pretrained (safetensors, float32), loads the directory
with kvfleet's Model and compares logits for the same ids: one prefill, and a token-by-token
decode through the KV pool. Prints max abs error and max error relative to max |logit|.

Needs torch and transformers, which are NOT kvfleet dependencies (install them by hand into
a scratch venv: `pip install torch transformers`).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = ("base", "yarn", "no_q_lora", "half_rope", "tied", "eps", "v2_greedy", "v2_grouped", "glm")


def hf_config(variant: str):
    from transformers import DeepseekV2Config, DeepseekV3Config, GlmMoeDsaConfig
    kw = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
              n_routed_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.5, kv_lora_rank=512,
              q_lora_rank=32, qk_rope_head_dim=64, qk_nope_head_dim=16, v_head_dim=16, n_group=2,
              topk_group=1, first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=512,
              rms_norm_eps=1e-6, rope_interleave=True, tie_word_embeddings=False, bos_token_id=0,
              eos_token_id=1, attn_implementation="eager")
    if variant == "yarn":
        kw["max_position_embeddings"] = 256
        kw["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                 "original_max_position_embeddings": 32, "beta_fast": 32,
                                 "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.7}
    elif variant == "no_q_lora":
        kw["q_lora_rank"] = None
    elif variant == "half_rope":
        kw["rope_interleave"] = False
    elif variant == "tied":
        kw["tie_word_embeddings"] = True
    elif variant == "eps":  # a large rms_norm_eps shows which norms read it
        kw["rms_norm_eps"] = 0.05
    elif variant == "glm":  # GLM-5 architecture; index_topk > tokens, so DSA keeps every key
        for k in ("rope_interleave", "num_key_value_heads"):
            kw.pop(k)
        kw.update(n_group=1, topk_group=1, rms_norm_eps=1e-5, index_topk=2048, index_head_dim=128,
                  index_n_heads=4, head_dim=64, mlp_layer_types=["dense", "sparse", "sparse"])
        return GlmMoeDsaConfig(**kw, num_key_value_heads=4)
    elif variant.startswith("v2_"):  # softmax routers (transformers' V2 ignores norm_topk_prob)
        for k in ("rope_interleave", "kv_lora_rank"):
            kw.pop(k)
        kw.update(kv_lora_rank=512, routed_scaling_factor=1.0, norm_topk_prob=False,
                  topk_method="greedy", n_group=None, topk_group=None)
        if variant == "v2_grouped":
            kw.update(topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5)
        return DeepseekV2Config(**kw)
    return DeepseekV3Config(**kw)


def build_hf_model(variant: str, seed: int):
    import torch
    from transformers import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, GlmMoeDsaForCausalLM
    torch.manual_seed(seed)
    cls = (DeepseekV2ForCausalLM if variant.startswith("v2_") else
           GlmMoeDsaForCausalLM if variant == "glm" else DeepseekV3ForCausalLM)
    model = cls(hf_config(variant)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.1)
            elif p.ndim == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 1.0 if "embed_tokens" in name else p.shape[-1] ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model


def compare(variant: str, n_tokens: int, seed: int) -> tuple[float, float, float, float]:
    import torch
    from kvstore.pool import KVPool
    from workers.model import Model
    hf = build_hf_model(variant, seed)
    ids = np.random.default_rng(seed).integers(0, 512, n_tokens)
    with torch.no_grad():
        ref = hf(torch.tensor(ids[None])).logits[0].double().numpy()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d, safe_serialization=True)
        model = Model.load(d)
    pool = KVPool.for_model(model.config, "f32", slots=2, max_ctx=n_tokens)
    a, b = pool.alloc_slot(), pool.alloc_slot()
    pre = model.forward(ids, [a] * n_tokens, np.arange(n_tokens), pool)
    dec = np.stack([model.forward([t], [b], [i], pool)[0] for i, t in enumerate(ids)])
    top = np.abs(ref).max()
    return (float(np.abs(pre - ref).max()), float(np.abs(pre - ref).max() / top),
            float(np.abs(dec - ref).max() / top), float((pre.argmax(-1) == ref.argmax(-1)).mean()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", choices=VARIANTS, help="default: all")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tol", type=float, default=1e-5, help="max relative error to pass")
    args = ap.parse_args(argv)
    import transformers
    print(f"transformers {transformers.__version__}; {args.tokens} tokens; "
          "rel = max|err| / max|logit|")
    print(f"{'variant':<10} {'prefill abs':>12} {'prefill rel':>12} {'decode rel':>12} {'argmax agree':>13}")
    ok = True
    for v in args.variant or VARIANTS:
        abs_e, rel_e, dec_e, agree = compare(v, args.tokens, args.seed)
        ok &= rel_e < args.tol and dec_e < args.tol
        print(f"{v:<10} {abs_e:12.3e} {rel_e:12.3e} {dec_e:12.3e} {agree:13.3f}")
    print("PASS" if ok else f"FAIL (tolerance {args.tol})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
