"""Writes models/kvfleet-mini/README.md (the model card) from the training log and, when given,
the `kvfleet bench quality --json` result and the parity figure.

    python scripts/model_card.py models/kvfleet-mini --quality q.json --parity parity.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _arch(cfg: dict) -> str:
    return "\n".join([
        f"- `DeepseekV3ForCausalLM` (model_type `{cfg['model_type']}`), {cfg['num_hidden_layers']} layers, "
        f"hidden {cfg['hidden_size']}, vocab {cfg['vocab_size']} (byte-level BPE, digits split one per token)",
        f"- MLA: {cfg['num_attention_heads']} heads, q_lora_rank {cfg['q_lora_rank']}, kv_lora_rank "
        f"{cfg['kv_lora_rank']}, qk_rope_head_dim {cfg['qk_rope_head_dim']}, qk_nope_head_dim "
        f"{cfg['qk_nope_head_dim']}, v_head_dim {cfg['v_head_dim']}, rope_theta "
        f"{cfg.get('rope_parameters', {}).get('rope_theta', cfg.get('rope_theta'))}, interleaved rope",
        f"- layers 0..{cfg['first_k_dense_replace'] - 1} dense SwiGLU (intermediate {cfg['intermediate_size']}); "
        f"the rest MoE: {cfg['n_routed_experts']} routed experts (intermediate "
        f"{cfg['moe_intermediate_size']}), top-{cfg['num_experts_per_tok']}, sigmoid scores + "
        f"e_score_correction_bias (noaux_tc, n_group {cfg['n_group']}, topk_group {cfg['topk_group']}), "
        f"routed_scaling_factor {cfg['routed_scaling_factor']}, {cfg['n_shared_experts']} shared expert",
        "- per token and layer the KV cache holds L (512 wide) and R (64 wide): the GLM-5 widths, so "
        "every kvfleet tier runs at its real row sizes",
    ])


def _quality(q: dict) -> str:
    tiers = q["tiers"]
    ctxs = sorted({c for t in tiers.values() for c in t["retrieval"]}, key=int)
    head = "| tier | " + " | ".join(f"retrieval @{c}" for c in ctxs) + \
        " | perplexity | top-1 agreement vs f32 | rel. logit error vs f32 |"
    rows = [head, "|" + " --- |" * (len(ctxs) + 4)]
    for name, t in tiers.items():
        cells = [f"{t['retrieval'][c]}/{q['items']}" for c in ctxs]
        rows.append(f"| {name} | " + " | ".join(cells) +
                    f" | {t['perplexity']:.3f} | {t['top1_agreement']:.3f} | {t['rel_logit_err']:.4f} |")
    return "\n".join(rows)


def render(log: dict, cfg: dict, quality: dict | None, parity: dict | None) -> str:
    ev = log["eval_hf"]
    ret = ", ".join(f"{v}/{ev['items']} at {k} tokens" for k, v in ev["retrieval"].items())
    parts = [
        "# kvfleet-mini",
        "",
        "A small DeepSeek-V3-architecture (MLA + MoE) model trained for kvfleet's tests, examples and "
        "quality benchmark. It writes Python-stdlib-flavoured text and answers key-value retrieval "
        "questions over its whole trained context; it is not a general assistant.",
        "",
        "## Architecture",
        "",
        _arch(cfg),
        f"- {log['params']:,} parameters; `model.safetensors` {log['safetensors_bytes']:,} bytes "
        "(bf16; the router weights and correction biases float32)",
        "",
        "## Training",
        "",
        f"- script: `python scripts/train_small_model.py --out models/kvfleet-mini --seed {log['seed']} "
        f"--steps {log['steps']}` (data: `scripts/make_training_data.py`)",
        f"- device: {log['device']}; date {log['date']}; torch {log['torch']}, transformers "
        f"{log['transformers']}, Python {log['python']}",
        f"- {log['steps']} steps of {log['batch']} x {log['ctx']} tokens = {log['tokens_seen']:,} tokens "
        f"in {log['wall_s']} s of training ({log['data_s']} s of data preparation before it)",
        f"- AdamW (betas 0.9/0.95, weight decay 0.1), peak lr {log['lr']}, {log['warmup']} warmup steps, "
        "cosine to 10%, bf16 autocast, gradient clip 1.0; DeepSeek-V3 auxiliary-loss-free expert "
        "balancing (correction bias step 1e-3)",
        f"- data mix: {log['text_tokens']:,} tokens of Python {log['python']} stdlib source "
        f"({log['stdlib_train_files']} files, {log['stdlib_train_mb']} MB, sorted order, every 25th "
        f"file held out: {log['heldout_files']} files) and {log['retrieval_tokens']:,} tokens of "
        f"generated retrieval documents ({log['retrieval_frac']:.0%} of rows hold one; "
        "`cluster/bench/retrieval_task.py` has the format)",
        f"- final training loss {log['final_loss']}",
        "",
        "## Evaluation",
        "",
        f"Right after training, read back with transformers in float32: retrieval {ret}; held-out "
        f"perplexity {ev['heldout_ppl']:.3f} over {ev['heldout_tokens']} tokens (8 x 512 tokens from the "
        "start of the held-out files, EOS between files; the table below uses `heldout.txt`, another "
        "span, so its perplexities differ).",
        "",
    ]
    if quality:
        parts += [
            "Through kvfleet's own engine and KV pool, per tier (`kvfleet bench quality --json`; "
            f"{quality['items']} retrieval items per context, drawn from a seed no training run uses; "
            "perplexity is teacher-forced decode through the cache, so every earlier position is read "
            "back from the tier; agreement and logit error compare each tier with f32 over the "
            "same greedy continuations):",
            "",
            _quality(quality),
            "",
        ]
    if parity:
        modes = ", ".join(f"{k} {v['max_rel_err']:.1e} over {v['positions']} positions"
                          for k, v in parity["modes"].items())
        parts += [f"Parity: `kvfleet score` (numpy engine, f32 tier) against transformers (float32) on "
                  f"the same checkpoint and held-out text, max |logit error| / max |logit|: {modes} "
                  f"(`{parity['command']}`).", ""]
    parts += [
        "## Limits",
        "",
        f"- The stdlib text ({log['stdlib_train_tokens']:,} tokens) was seen about "
        f"{log['text_tokens'] / max(1, log['stdlib_train_tokens']):.0f} times, so the training loss "
        "on text is partly memorisation; the held-out perplexity is the figure to quote.",
        "- Retrieval is trained only up to the trained context (1024 tokens); longer prompts are "
        "outside what it learned.",
        "- `heldout.txt` holds held-out stdlib text (files never trained on) for the perplexity figures.",
        ""]
    return "\n".join(parts)


def write_card(out: Path, log: dict, cfg, quality: dict | None = None, parity: dict | None = None):
    cfg_d = cfg if isinstance(cfg, dict) else json.loads((Path(out) / "config.json").read_text())
    (Path(out) / "README.md").write_text(render(log, cfg_d, quality, parity))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--quality", type=Path, help="kvfleet bench quality --json output")
    ap.add_argument("--parity", type=Path, help="JSON with max_rel_err, tokens, command")
    args = ap.parse_args()
    log = json.loads((args.model_dir / "train_log.json").read_text())
    cfg = json.loads((args.model_dir / "config.json").read_text())
    q = json.loads(args.quality.read_text()) if args.quality else None
    p = json.loads(args.parity.read_text()) if args.parity else None
    write_card(args.model_dir, log, cfg, q, p)
    print(f"wrote {args.model_dir / 'README.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
