"""Train the small MLA-MoE model that ships in models/kvfleet-mini (issue 7).

Architecture: transformers' DeepseekV3ForCausalLM (the DeepSeek-V3 / GLM-5 family): MLA with
kv_lora_rank 512 and qk_rope_head_dim 64 (GLM-5's cache widths), q_lora_rank null, 4 layers
(layer 0 dense, 1..3 MoE with 8 routed experts, top-2, sigmoid scores with the noaux_tc
bias, one shared expert), hidden 256, vocab 2048 byte-level BPE. bf16 on disk, under 8 MB.

Data: scripts/make_training_data.py (stdlib source + generated key-value retrieval).
Deterministic given --seed and --steps (with --steps 0 the step count is fixed from the time
budget after the first warmup steps; the run prints it so that `--steps N` repeats the run).

    python scripts/train_small_model.py --out models/kvfleet-mini            # GPU, ~5 min
    python scripts/train_small_model.py --out /tmp/m --device cpu --steps 3 --batch 2 --ctx 128
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import queue
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import make_training_data as data  # noqa: E402
from model_card import write_card  # noqa: E402

from cluster.bench import retrieval_task as rt  # noqa: E402


def model_config(vocab: int, eos: int, ctx: int):
    from transformers import DeepseekV3Config
    return DeepseekV3Config(
        vocab_size=vocab, hidden_size=256, intermediate_size=320, moe_intermediate_size=48,
        num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
        num_nextn_predict_layers=0, max_position_embeddings=max(ctx, 4096), rope_theta=10000.0,
        rope_interleave=True, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=eos,
        eos_token_id=eos, pad_token_id=None, attention_bias=False, initializer_range=0.02)


def dense_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Same function as DeepseekV3Experts.forward (sum over the top-k experts of weight x
    SwiGLU expert), computed for all experts at once with zero weight for the unchosen ones:
    no per-expert gather loop, no host sync."""
    w = torch.zeros(hidden_states.shape[0], self.num_experts, device=hidden_states.device,
                    dtype=top_k_weights.dtype).scatter(1, top_k_index, top_k_weights)
    gu = torch.einsum("nh,eih->nei", hidden_states, self.gate_up_proj)
    gate, up = gu.chunk(2, dim=-1)
    act = F.silu(gate) * up * w.unsqueeze(-1).to(gu.dtype)
    return torch.einsum("nei,ehi->nh", act, self.down_proj).to(hidden_states.dtype)


def router_gates(model) -> list:
    return [m for n, m in model.named_modules() if n.endswith("mlp.gate")]


class RouterLoads:
    """Counts the tokens routed to each expert per MoE layer (forward hooks on the gates), for
    DeepSeek-V3's auxiliary-loss-free balancing: after each step the correction bias of an
    overloaded expert goes down by `rate`, of an underloaded one up."""

    def __init__(self, model, rate: float):
        self.gates = router_gates(model)
        self.rate = rate
        self.counts = [torch.zeros(g.num_experts, device=g.weight.device) for g in self.gates]
        for g, c in zip(self.gates, self.counts):
            g.register_forward_hook(self._hook(c))

    @staticmethod
    def _hook(count):
        def hook(_module, _inp, out):
            idx = out[2].reshape(-1)
            count.add_(torch.bincount(idx, minlength=count.numel()).to(count.dtype))
        return hook

    @torch.no_grad()
    def update(self):
        for g, c in zip(self.gates, self.counts):
            g.e_score_correction_bias.add_(self.rate * torch.sign(c.mean() - c))
            c.zero_()

    def imbalance(self) -> list[float]:
        return [float(g.e_score_correction_bias.abs().max()) for g in self.gates]


def prefetch(batches, depth=4):
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def work():
        while not stop.is_set():
            r0, t0 = batches.retrieval_tokens, batches.text_tokens
            x = torch.from_numpy(batches.next())
            x = x.pin_memory() if torch.cuda.is_available() else x
            q.put((x, batches.retrieval_tokens - r0, batches.text_tokens - t0))
    threading.Thread(target=work, daemon=True).start()
    return q, stop


def lr_at(step, total, warmup, peak, floor=0.1):
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


@torch.no_grad()
def greedy(model, ids: torch.Tensor, n_new: int) -> torch.Tensor:
    """Greedy continuation of equal-length prompts [B, T] by full forwards (no cache)."""
    out = ids
    for _ in range(n_new):
        nxt = model(input_ids=out).logits[:, -1].argmax(-1, keepdim=True)
        out = torch.cat([out, nxt], 1)
    return out[:, ids.shape[1]:]


@torch.no_grad()
def evaluate_hf(model_dir: Path, tok, device: str, contexts, n_items: int, heldout_ids) -> dict:
    """Retrieval accuracy and held-out perplexity of the saved checkpoint, read back with
    transformers in float32 (the reference side of the oracle)."""
    from transformers import DeepseekV3ForCausalLM
    torch.backends.cuda.matmul.allow_tf32 = False
    m = DeepseekV3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    res = {"retrieval": {}, "items": n_items}
    for ctx in contexts:
        items = rt.oracle_items(n_items, ctx)
        ids = [tok.encode(it.prompt, add_special_tokens=False).ids for it in items]
        if len({len(x) for x in ids}) != 1:
            raise RuntimeError(f"oracle prompts at context {ctx} tokenize to unequal lengths")
        gen = greedy(m, torch.tensor(ids, device=device), 6).tolist()
        res["retrieval"][str(ctx)] = sum(rt.is_correct(it, tok.decode(g)) for it, g in zip(items, gen))
    x = torch.tensor(heldout_ids, dtype=torch.long, device=device)
    logits = m(input_ids=x).logits.float()
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
    res["heldout_ppl"] = float(torch.exp(nll))
    res["heldout_tokens"] = int(x[:, 1:].numel())
    return res


def save(model, tok, cfg, out: Path):
    out.mkdir(parents=True, exist_ok=True)
    m = model.to(torch.bfloat16)
    for g in router_gates(m):  # router weight and correction bias stay float32
        g.float()
    m.save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "do_sample": False,
           "max_new_tokens": 64}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=0, help="0: as many as --time-budget allows")
    ap.add_argument("--time-budget", type=float, default=300.0, help="seconds of training")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--max-mb", type=float, default=40.0, help="stdlib training text cap")
    ap.add_argument("--retrieval-frac", type=float, default=0.6)
    ap.add_argument("--eval-items", type=int, default=32)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    if args.seed == rt.ORACLE_SEED:
        raise SystemExit(f"--seed {args.seed} is the oracle's seed; pick another")
    t_start = time.time()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    corpus = data.stdlib_corpus(args.max_mb)
    tok = data.train_tokenizer(corpus.train_text[::3] + data.sample_documents(2000, args.seed), args.vocab)
    stream = data.encode_stream(tok, corpus.train_text)
    rids = data.RetrievalIds(tok)
    held_stream = data.encode_stream(tok, corpus.heldout_text)
    n_held = min(8, len(held_stream) // 512)
    heldout_ids = held_stream[:n_held * 512].reshape(n_held, 512)
    t_data = time.time() - t_start
    print(f"data: {len(corpus.train_files)} stdlib files {corpus.train_bytes / 1e6:.1f} MB -> "
          f"{len(stream)} tokens; {len(corpus.heldout_files)} held-out files; vocab "
          f"{tok.get_vocab_size()}; {t_data:.1f} s", flush=True)

    from transformers import DeepseekV3ForCausalLM
    cfg = model_config(tok.get_vocab_size(), rids.eos, args.ctx)
    cfg._attn_implementation = "sdpa"
    model = DeepseekV3ForCausalLM(cfg).to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params} parameters ({n_params * 2 / 1e6:.2f} MB in bf16)", flush=True)
    for mod in model.modules():
        if type(mod).__name__ == "DeepseekV3Experts":
            mod.forward = dense_experts_forward.__get__(mod)
    loads = RouterLoads(model, rate=1e-3)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "gate.weight" not in n]
    other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "gate.weight" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=args.device.startswith("cuda"))
    batches = data.Batches(stream, rids, args.ctx, args.batch, args.retrieval_frac, args.seed)
    q, stop = prefetch(batches)
    # bf16 autocast on the GPU; on a CPU (smoke runs) bf16 matmuls are slow, so float32 there
    amp = torch.autocast(device_type=args.device.split(":")[0], dtype=torch.bfloat16,
                         enabled=args.device.startswith("cuda"))
    total = args.steps if args.steps > 0 else 10 ** 9
    losses, step, t_train, t_mark = [], 0, time.time(), None
    seen_ret = seen_text = 0
    model.train()
    while step < total:
        x, n_ret, n_text = q.get()
        x = x.to(args.device, non_blocking=True)
        seen_ret, seen_text = seen_ret + n_ret, seen_text + n_text
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, args.warmup, args.lr)
        with amp:
            loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loads.update()
        step += 1
        if step % 25 == 0 or step == total:
            losses.append((step, loss.item()))
            el = time.time() - t_train
            print(f"step {step} loss {losses[-1][1]:.4f} lr {opt.param_groups[0]['lr']:.2e} "
                  f"{el:.0f} s, bias max {max(loads.imbalance()):.3f}", flush=True)
        if args.steps == 0 and step == 20:
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t_mark = time.time()
        if args.steps == 0 and step == 60:
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            per = (time.time() - t_mark) / 40
            total = max(args.warmup + 1, int((args.time_budget - (time.time() - t_train)) / per) + step)
            print(f"{per * 1000:.1f} ms/step -> {total} steps in total (repeat with --steps {total})",
                  flush=True)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    stop.set()
    wall = time.time() - t_train
    tokens = total * args.batch * args.ctx
    final = float(np.mean([l for _, l in losses[-4:]]))
    print(f"trained {total} steps, {tokens} tokens in {wall:.0f} s; final loss {final:.4f}", flush=True)

    save(model, tok, cfg, args.out)
    ev = evaluate_hf(args.out, tok, args.device, [c for c in (256, 512, 1024) if c <= args.ctx],
                     args.eval_items, heldout_ids)
    print(f"eval (transformers f32): {json.dumps(ev)}", flush=True)
    (args.out / "heldout.txt").write_text("".join(corpus.heldout_text)[:200_000])
    size = (args.out / "model.safetensors").stat().st_size
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    log = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": dev, "seed": args.seed, "steps": total, "batch": args.batch, "ctx": args.ctx,
        "tokens_seen": tokens, "retrieval_tokens": seen_ret,
        "text_tokens": seen_text, "wall_s": round(wall, 1), "data_s": round(t_data, 1),
        "final_loss": round(final, 4), "lr": args.lr, "warmup": args.warmup,
        "retrieval_frac": args.retrieval_frac, "params": n_params, "safetensors_bytes": size,
        "stdlib_root": corpus.root, "stdlib_train_files": len(corpus.train_files),
        "stdlib_train_mb": round(corpus.train_bytes / 1e6, 2), "stdlib_train_tokens": int(len(stream)),
        "heldout_files": len(corpus.heldout_files), "torch": torch.__version__,
        "transformers": __import__("transformers").__version__, "eval_hf": ev, "losses": losses,
        "python": sys.version.split()[0]}
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    write_card(args.out, log, cfg)
    print(f"saved {args.out}: model.safetensors {size} bytes; total {time.time() - t_start:.0f} s")
    os._exit(0)  # the prefetch thread may be blocked on a full queue


if __name__ == "__main__":
    sys.exit(main())
