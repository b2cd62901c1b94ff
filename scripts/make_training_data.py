"""Training data for the shipped model (models/kvfleet-mini): Python's own stdlib source (with
its docstrings and pydoc topics) mixed with generated key-value retrieval documents
(cluster/bench/retrieval_task.py), and the byte-level BPE tokenizer trained on that text.

Everything is deterministic: files are taken in sorted order from the running Python's stdlib
folder, a fixed file-index rule splits train from held-out, and every batch is drawn from a
`numpy.random.default_rng(seed)` stream.

Run alone it prints the corpus figures and a sample batch:
    python scripts/make_training_data.py --vocab 2048 --max-mb 8
"""
from __future__ import annotations

import argparse
import os
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cluster.bench import retrieval_task as rt  # noqa: E402

EOS = "<|endoftext|>"
HELDOUT_EVERY = 25  # file i (sorted order) is held out when i % 25 == 7
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "idlelib", "turtledemo"}


@dataclass
class Corpus:
    root: str
    train_files: list[str]
    heldout_files: list[str]
    train_text: list[str]
    heldout_text: list[str]

    @property
    def train_bytes(self) -> int:
        return sum(len(t.encode()) for t in self.train_text)


def stdlib_corpus(max_mb: float) -> Corpus:
    """Sorted .py files of the running interpreter's stdlib (no site-packages), split by index;
    training files are kept in sorted order until `max_mb` megabytes."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        paths += [os.path.join(dirpath, f) for f in sorted(files) if f.endswith(".py")]
    paths.sort()
    if not paths:
        raise FileNotFoundError(f"no .py files under the stdlib folder {root!r}")
    train, held, ttext, htext, total = [], [], [], [], 0
    for i, p in enumerate(paths):
        try:
            text = Path(p).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # a few test fixtures are deliberately not UTF-8; they are not training text
        rel = os.path.relpath(p, root)
        if i % HELDOUT_EVERY == 7:
            held.append(rel)
            htext.append(text)
        elif total < max_mb * 1e6:
            train.append(rel)
            ttext.append(text)
            total += len(text.encode())
    return Corpus(root, train, held, ttext, htext)


def sample_documents(n: int, seed: int) -> list[str]:
    """Retrieval documents as text (for tokenizer training and the round-trip check)."""
    rng = np.random.default_rng([seed, 7])
    docs = []
    for _ in range(n):
        p = int(rng.integers(2, 60))
        keys = rng.choice(rt.KEY_SPACE, size=p, replace=False)
        vals = rng.integers(0, rt.KEY_SPACE, size=p)
        asked = rng.integers(0, p, size=max(1, p // 4))
        docs.append("".join(rt.pair_line(int(k), int(v)) for k, v in zip(keys, vals))
                    + "".join(rt.question(int(keys[a])) + rt.answer(int(vals[a])) + "\n" for a in asked))
    return docs


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE; digits are split one per token so that numbers tokenize uniformly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_stream(tok, texts: list[str]) -> np.ndarray:
    """All texts tokenized and joined, each followed by EOS, as one int32 array."""
    eos = tok.token_to_id(EOS)
    parts = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        parts.append(np.asarray(enc.ids + [eos], np.int32))
    return np.concatenate(parts)


class RetrievalIds:
    """Token ids of the fixed pieces of a retrieval document, checked against the tokenizer."""

    def __init__(self, tok):
        def ids(s):
            return np.asarray(tok.encode(s, add_special_tokens=False).ids, np.int32)
        self.digit = np.array([ids(str(d))[0] for d in range(10)], np.int32)
        if any(len(ids(str(d))) != 1 for d in range(10)):
            raise ValueError("the tokenizer does not map each digit to one token")
        self.k, self.colon_v, self.nl = ids("k"), ids(": v"), ids("\n")
        self.ask, self.qmark_v = ids("value of k"), ids("? v")
        self.eos = tok.token_to_id(EOS)
        for doc in sample_documents(50, seed=3):  # the pieces must compose to the real encoding
            lines = doc.splitlines()
            pairs = [tuple(int(x) for x in ln[1:].split(": v")) for ln in lines if ln.startswith("k")]
            qs = [tuple(int(x) for x in ln[len("value of k"):].split("? v")) for ln in lines
                  if ln.startswith("value")]
            got = self.document(np.array(pairs).reshape(-1, 2), np.array(qs).reshape(-1, 2))
            want = ids(doc)
            if not np.array_equal(got, want):
                raise ValueError(f"retrieval pieces do not compose to the tokenizer's encoding: "
                                 f"{got[:24].tolist()} vs {want[:24].tolist()}")

    def _lines(self, head, kv, mid, tail):
        n = len(kv)
        dk = self.digit[(kv[:, :1] // np.array([100, 10, 1])) % 10]
        dv = self.digit[(kv[:, 1:] // np.array([100, 10, 1])) % 10]
        cols = [np.tile(head, (n, 1)), dk, np.tile(mid, (n, 1)), dv, np.tile(tail, (n, 1))]
        return np.concatenate(cols, axis=1).reshape(-1)

    def document(self, pairs: np.ndarray, questions: np.ndarray) -> np.ndarray:
        """pairs [P, 2] and questions [Q, 2] of (key, value) -> token ids of the document."""
        return np.concatenate([self._lines(self.k, pairs, self.colon_v, self.nl),
                               self._lines(self.ask, questions, self.qmark_v, self.nl)]).astype(np.int32)


class Batches:
    """Deterministic training batches [batch, ctx] int64: a `retrieval_frac` share of the rows
    hold one retrieval document (64..ctx tokens) with stdlib text before or after it (EOS
    between), the rest are stdlib text windows."""

    def __init__(self, stream: np.ndarray, rids: RetrievalIds, ctx: int, batch: int,
                 retrieval_frac: float, seed: int):
        if len(stream) <= ctx:
            raise ValueError(f"text stream of {len(stream)} tokens is shorter than ctx {ctx}")
        self.stream, self.rids, self.ctx, self.batch = stream, rids, ctx, batch
        self.frac = retrieval_frac
        self.rng = np.random.default_rng([seed, 1])
        self.text_tokens = 0
        self.retrieval_tokens = 0

    def _text(self, n: int) -> np.ndarray:
        o = int(self.rng.integers(0, len(self.stream) - n))
        return self.stream[o:o + n]

    def _retrieval_doc(self) -> np.ndarray:
        rng = self.rng
        length = int(rng.integers(64, self.ctx + 1))
        qfrac = rng.uniform(0.1, 0.5)
        nq = max(1, round(qfrac * length / rt.QUESTION_TOKENS))
        npairs = max(2, (length - rt.QUESTION_TOKENS * nq) // rt.PAIR_TOKENS)
        while rt.PAIR_TOKENS * npairs + rt.QUESTION_TOKENS * nq > self.ctx:
            nq -= 1
        keys = rng.choice(rt.KEY_SPACE, size=npairs, replace=False)
        vals = rng.integers(0, rt.KEY_SPACE, size=npairs)
        asked = rng.integers(0, npairs, size=max(nq, 1))
        pairs = np.stack([keys, vals], 1)
        return self.rids.document(pairs, pairs[asked])

    def next(self) -> np.ndarray:
        out = np.empty((self.batch, self.ctx), np.int64)
        eos = self.rids.eos
        for b in range(self.batch):
            if self.rng.random() < self.frac:
                doc = self._retrieval_doc()
                rest = self.ctx - len(doc)
                if rest == 0:
                    row = doc
                elif self.rng.random() < 0.5:  # text, EOS, document
                    row = np.concatenate([self._text(rest - 1), [eos], doc])
                else:  # document at position 0, EOS, text
                    row = np.concatenate([doc, [eos], self._text(rest - 1)])
                self.retrieval_tokens += len(doc)
                self.text_tokens += self.ctx - len(doc)
            else:
                row = self._text(self.ctx)
                self.text_tokens += self.ctx
            out[b] = row
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--max-mb", type=float, default=8.0)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    t = time.time()
    corpus = stdlib_corpus(args.max_mb)
    print(f"stdlib {corpus.root}: {len(corpus.train_files)} train files "
          f"({corpus.train_bytes / 1e6:.1f} MB), {len(corpus.heldout_files)} held out "
          f"({time.time() - t:.1f} s)")
    t = time.time()
    tok = train_tokenizer(corpus.train_text + sample_documents(2000, args.seed), args.vocab)
    stream = encode_stream(tok, corpus.train_text)
    print(f"tokenizer {tok.get_vocab_size()} tokens; train stream {len(stream)} tokens "
          f"({corpus.train_bytes / len(stream):.2f} bytes/token) ({time.time() - t:.1f} s)")
    batches = Batches(stream, RetrievalIds(tok), 256, 4, 0.5, args.seed)
    row = batches.next()[0]
    print(repr(tok.decode(row.tolist())[:300]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
