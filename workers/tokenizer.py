"""The checkpoint's tokenizer (tokenizer.json via the `tokenizers` library) and its EOS ids.

EOS ids are the union of config.json's and generation_config.json's `eos_token_id` (each an
int or a list): generation stops on any of them.

A text prompt is encoded as Hugging Face tokenizers and vLLM encode one by default: with the
special tokens that tokenizer.json's post-processor adds (a BOS for the DeepSeek-V3 family;
nothing for a tokenizer without one, like kvfleet-mini's). `encode` alone adds none.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


class TokenizerError(ValueError):
    """A checkpoint dir without a usable tokenizer.json: names the file."""


def _ids(path: Path, key: str) -> list[int]:
    if not path.exists():
        return []
    try:
        v = json.loads(path.read_text()).get(key)
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise TokenizerError(f"{path}: not a JSON object ({e})") from None
    if v is None:
        return []
    items = v if isinstance(v, list) else [v]
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in items):
        raise TokenizerError(f"{path}: {key}={v!r} must be an int or a list of ints")
    return items


class Tokenizer:
    def __init__(self, tok: _HFTokenizer, eos_ids: tuple[int, ...], bos_id: int | None):
        self._tok, self.eos_ids, self.bos_id = tok, eos_ids, bos_id

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        d = Path(model_dir)
        path = d / "tokenizer.json"
        if not path.exists():
            raise TokenizerError(f"{path}: no tokenizer.json in the model dir")
        try:
            tok = _HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception on a bad file
            raise TokenizerError(f"{path}: cannot load tokenizer ({e})") from None
        eos: list[int] = []
        for name in ("generation_config.json", "config.json"):
            eos += [i for i in _ids(d / name, "eos_token_id") if i not in eos]
        bos = (_ids(d / "generation_config.json", "bos_token_id") or _ids(d / "config.json", "bos_token_id") or [None])[0]
        return cls(tok, tuple(eos), bos)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids

    def encode_prompt(self, text: str) -> list[int]:
        """A request's text prompt: with the post-processor's special tokens (see above)."""
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def is_eos(self, token: int) -> bool:
        return int(token) in self.eos_ids
