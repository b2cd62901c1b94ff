"""Parity of a trained checkpoint: `kvfleet score` (numpy engine, f32 KV tier) against
transformers' DeepseekV3ForCausalLM in float32, on held-out text of the model dir.

    python scripts/check_checkpoint_parity.py models/kvfleet-mini [--tokens 1024] [--json OUT]

Prints the max |logit difference| over all positions relative to the max |logit| of the
reference, per mode (prefill, teacher-forced decode), and the argmax agreement. Needs torch
and transformers, which are not kvfleet dependencies.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--decode-tokens", type=int, default=256, help="positions for the decode mode")
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args()
    import torch
    from tokenizers import Tokenizer
    from transformers import DeepseekV3ForCausalLM

    tok = Tokenizer.from_file(str(args.model_dir / "tokenizer.json"))
    text = (args.model_dir / "heldout.txt").read_text()
    ids = tok.encode(text, add_special_tokens=False).ids[:args.tokens]
    hf = DeepseekV3ForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0].numpy()
    res = {"tokens": len(ids), "modes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, n in (("prefill", len(ids)), ("decode", min(args.decode_tokens, len(ids)))):
            (Path(tmp) / "ids.json").write_text(json.dumps(ids[:n]))
            cmd = ["kvfleet", "score", "--model", str(args.model_dir), "--tokens", f"{tmp}/ids.json",
                   "--out", f"{tmp}/{mode}.npy", "--mode", mode]
            subprocess.run([sys.executable, "-m", "cluster", *cmd[1:]], check=True,
                           cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL)
            got = np.load(f"{tmp}/{mode}.npy")
            r = ref[:n]
            res["modes"][mode] = {
                "positions": n,
                "max_rel_err": float(np.abs(got - r).max() / np.abs(r).max()),
                "argmax_agreement": float((got.argmax(-1) == r.argmax(-1)).mean()),
                "command": " ".join(cmd[:4]) + " ... --mode " + mode}
    res["max_rel_err"] = max(m["max_rel_err"] for m in res["modes"].values())
    res["command"] = f"python scripts/check_checkpoint_parity.py {args.model_dir}"
    print(json.dumps(res, indent=1))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
