"""The progress line's rate counts from the start of generation, not of the workers."""
import logging

from cluster.jobs import progress


def test_rate_counts_from_started(monkeypatch, caplog):
    now = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    bar = progress.Progress(2, every_s=0.0, tty=False)
    now[0] = 160.0  # a minute of Ray start and model loads
    bar.started()
    now[0] = 162.0
    with caplog.at_level(logging.INFO, logger=progress.__name__):
        bar.update(10)
        now[0] = 164.0
        bar.update(10)
    assert "1/2 prompts, 10 tokens, 5.0 tok/s" in caplog.text
    assert "2/2 prompts, 20 tokens, 5.0 tok/s" in caplog.text
