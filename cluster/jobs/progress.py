"""Progress of a job: a bar on a terminal (tqdm when installed, else one carriage-return
line), periodic log lines otherwise (Ray job logs, CI, files)."""
from __future__ import annotations

import importlib.util
import logging
import sys
import time

log = logging.getLogger(__name__)


class Progress:
    def __init__(self, total: int, every_s: float = 10.0, tty: bool | None = None):
        self.total, self.every_s = total, every_s
        self.done = self.tokens = 0
        self.t0 = self._last = time.monotonic()
        self.tty = sys.stderr.isatty() if tty is None else tty
        self._bar = None
        if self.tty and importlib.util.find_spec("tqdm") is not None:
            from tqdm import tqdm
            self._bar = tqdm(total=total, unit="prompt", file=sys.stderr, dynamic_ncols=True)

    def started(self) -> None:
        """Generation begins (workers up): the tok/s rate counts from here, not from the
        start of Ray and the model loads."""
        self.t0 = time.monotonic()

    def update(self, tokens: int = 0) -> None:
        self.done += 1
        self.tokens += tokens
        now = time.monotonic()
        rate = self.tokens / max(now - self.t0, 1e-9)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=False)
        elif self.tty:
            print(f"\r{self.done}/{self.total} prompts, {self.tokens} tokens, {rate:.1f} tok/s",
                  end="", file=sys.stderr, flush=True)
        elif now - self._last >= self.every_s or self.done == self.total:
            self._last = now
            log.info("progress: %d/%d prompts, %d tokens, %.1f tok/s", self.done, self.total,
                     self.tokens, rate)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.tty and self.done:
            print(file=sys.stderr)
