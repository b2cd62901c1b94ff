"""Results files with flipped bits or cut short are refused, never misread; an older
kvfleet's file (no digest) still resumes, with a warning."""
from __future__ import annotations

import json
import logging
import math
import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from cluster.cli import main
from cluster.config import JobConfigError
from cluster.jobs.results_store import ResultStore
from cluster.requests import Result, results_table
from runtime_helpers import prompt_lines, write_lines

SETTINGS = {"kv": "f32", "model": "m", "max_context": 64}


def hostile_results(n: int = 40) -> list[Result]:
    """Rows of every kind: error rows without an id, empty and non-ASCII text, NaN timings."""
    rng = random.Random(7)
    out = []
    for i in range(n):
        toks = [rng.randrange(2 ** 31) for _ in range(rng.randrange(0, 12))]
        err = i % 7 == 3
        out.append(Result(id=None if err else f"q{i}", line=i + 1,
                          prompt=None if err else "é\u4e2d " * rng.randrange(0, 6) + str(i),
                          completion="" if err else f"done {i} \U0001F600", completion_tokens=toks,
                          prompt_token_count=rng.randrange(100),
                          completion_token_count=len(toks),
                          finish_reason="error" if err else ("stop", "length")[i % 2],
                          error=f"line {i + 1}: bad" if err else None, tier="f32", worker="w0",
                          ttft_s=math.nan if i % 5 == 0 else rng.random(),
                          decode_tokens_per_s=None if err else rng.random() * 100,
                          request_digest=None if err else f"{i:016x}"))
    return out


@pytest.fixture
def written(tmp_path) -> Path:
    """An OUT written by ResultStore's own finalize (the merge of three parts)."""
    out = tmp_path / "good.parquet"
    store = ResultStore(out, flush_every=15, settings=SETTINGS)
    for r in hostile_results():
        store.add(r)
    store.finalize()
    store.close()
    return out


def resumed(out: Path) -> list[dict]:
    """What a rerun on `out` carries forward: the rows its finalize writes."""
    store = ResultStore(out, settings=SETTINGS)
    try:
        store.done_keys()
        return store.finalize().to_pylist()
    finally:
        store.close()


def same(a: list[dict], b: list[dict]) -> bool:
    """Row lists equal, NaN equal to NaN."""
    def norm(rows):
        return [{k: "nan" if isinstance(v, float) and math.isnan(v) else v
                 for k, v in r.items()} for r in rows]
    return norm(a) == norm(b)


def flip_each(src: Path, bits, tmp_path: Path):
    """(bit, copy of src with that bit flipped), one at a time."""
    data = src.read_bytes()
    for bit in bits:
        b = bytearray(data)
        b[bit // 8] ^= 1 << (bit % 8)
        copy = tmp_path / "flipped" / "out.parquet"
        copy.parent.mkdir(exist_ok=True)
        copy.write_bytes(bytes(b))
        yield bit, copy


def check_never_misread(src: Path, bits, tmp_path: Path) -> int:
    """Every flip is refused (JobConfigError naming --out) or reads back the same rows.
    Returns how many were refused."""
    want = resumed(src)
    refused = 0
    for bit, copy in flip_each(src, bits, tmp_path):
        try:
            got = resumed(copy)
        except JobConfigError as e:
            assert f"{copy}: cannot read earlier results" in str(e), (bit, e)
            assert "\n" not in str(e)
            refused += 1
            continue
        assert same(got, want), f"bit {bit}: a damaged file read back as other rows"
    return refused


def test_flips_in_data_pages_are_refused(written, tmp_path):
    """Bits of the column chunks (page headers and data, every column): it was 65 of 300
    flips over a whole file read back as other rows, with no error."""
    meta = pq.ParquetFile(written).metadata
    rg = meta.row_group(0)
    spans = []
    for j in range(rg.num_columns):
        c = rg.column(j)
        start = c.dictionary_page_offset or c.data_page_offset
        spans.append(range(start * 8, (start + c.total_compressed_size) * 8))
    rng = random.Random(1)
    bits = [rng.choice(s) for s in spans for _ in range(12)]
    assert check_never_misread(written, bits, tmp_path) >= len(bits) * 3 // 4


def test_flips_in_the_footer_are_refused(written, tmp_path):
    """Bits of the footer (schema, the settings and digest metadata, column metadata)."""
    data = written.read_bytes()
    footer_len = int.from_bytes(data[-8:-4], "little")
    start = len(data) - 8 - footer_len
    rng = random.Random(2)
    bits = rng.sample(range(start * 8, (len(data) - 8) * 8), 200)
    # and every bit of the first key's name (Parquet's own copy of the metadata, which pyarrow
    # reads only where its copy in ARROW:schema is missing)
    meta_at = data.index(b"kvfleet.settings")
    bits += range(meta_at * 8, (meta_at + len(b"kvfleet.settings")) * 8)
    assert check_never_misread(written, bits, tmp_path) >= 100


def test_a_cut_short_file_is_refused(written, tmp_path):
    data = written.read_bytes()
    copy = tmp_path / "cut" / "out.parquet"
    copy.parent.mkdir()
    for n in (0, 4, len(data) // 2, len(data) - 9, len(data) - 1):
        copy.write_bytes(data[:n])
        with pytest.raises(JobConfigError, match=f"^--out {copy}: cannot read earlier results"):
            resumed(copy)
        assert copy.read_bytes() == data[:n]  # left as it is


def test_a_damaged_part_is_named(written, tmp_path):
    out = tmp_path / "o" / "out.parquet"
    store = ResultStore(out, flush_every=5, settings=SETTINGS)
    for r in hostile_results(12):
        store.add(r)
    store.close()
    part = sorted((out.parent / "out.parquet.parts").iterdir())[1]
    b = bytearray(part.read_bytes())
    b[len(b) // 3] ^= 0x10
    part.write_bytes(bytes(b))
    with pytest.raises(JobConfigError, match=f"^--out {out}: part {part}: cannot read earlier"):
        resumed(out)
    assert part.read_bytes() == bytes(b)


def test_an_older_kvfleets_file_still_resumes_with_one_warning(tmp_path, caplog):
    """As the previous release wrote OUT: settings metadata, no page checksums, no digest."""
    out = tmp_path / "out.parquet"
    rows = hostile_results()
    table = results_table(rows).replace_schema_metadata(
        {b"kvfleet.settings": json.dumps(SETTINGS, sort_keys=True)})
    pq.write_table(table, out)
    caplog.set_level(logging.WARNING)
    store = ResultStore(out, settings=SETTINGS)
    try:
        assert len(store.done_keys()) == sum(r.finish_reason != "error" for r in rows)
        merged = store.finalize()
    finally:
        store.close()
    said = [r for r in caplog.records if "no row digest" in r.getMessage()]
    assert len(said) == 1 and str(out) in said[0].getMessage()  # (read three times: said once)
    assert same(merged.to_pylist(), results_table(rows).to_pylist())
    assert b"kvfleet.digest" in pq.read_schema(out).metadata  # rewritten with one
    caplog.clear()
    assert same(resumed(out), merged.to_pylist())
    assert not [r for r in caplog.records if "no row digest" in r.getMessage()]


def test_rerun_on_a_damaged_out_is_one_line_exit_2_and_keeps_it(tiny, tmp_path, capsys):
    prompts = write_lines(tmp_path / "p.jsonl", prompt_lines(3))
    out = tmp_path / "out.parquet"
    args = ["generate", "--prompts", str(prompts), "--model", str(tiny), "--inprocess",
            "--max-tokens", "2", "--out", str(out)]
    assert main(args + ["--limit", "2"]) == 0
    capsys.readouterr()
    data = bytearray(out.read_bytes())
    c = pq.ParquetFile(out).metadata.row_group(0).column(2)
    data[(c.dictionary_page_offset or c.data_page_offset) + c.total_compressed_size - 1] ^= 0x04
    out.write_bytes(bytes(data))  # (the last byte of the `completion` column's last page)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvfleet generate: error: --out {out}: cannot read earlier results")
    assert len(err.strip().splitlines()) == 1, err
    assert out.read_bytes() == bytes(data) and not Path(f"{out}.lock").exists()


def test_files_of_a_newer_kvfleet_and_of_other_tools_still_read(written, tmp_path):
    """A newer kvfleet's OUT (a column and a metadata key this one does not know) is read,
    its digest checked over the columns as written; an OUT rewritten by pandas (no digest,
    a `pandas` key) reads unchecked; a kvfleet-like key on a file without a digest (the
    digest's own name damaged) is refused. The first two were refused as 'damaged'."""
    import pyarrow as pa

    from cluster.jobs.results_file import (DIGEST_KEY, SETTINGS_KEY, ResultsFileError,
                                           read_results, rows_digest)
    t = pq.read_table(written)
    meta = t.schema.metadata
    newer = t.append_column("kvfleet_later", pa.array([[i, i] for i in range(t.num_rows)]))
    new_meta = {SETTINGS_KEY: meta[SETTINGS_KEY], b"kvfleet.version": b"9.9",
                DIGEST_KEY: rows_digest(newer, meta[SETTINGS_KEY]).encode()}
    pq.write_table(newer.replace_schema_metadata(new_meta), tmp_path / "newer.parquet",
                   write_page_checksum=True)
    got = read_results(tmp_path / "newer.parquet")
    assert got.checked and same(got.table.to_pylist(), read_results(written).table.to_pylist())
    # (and its rows are still checked: one changed value is refused)
    bad = newer.set_column(0, t.schema.field(0), pa.array(["x"] + t.column(0).to_pylist()[1:],
                                                           t.schema.field(0).type))
    pq.write_table(bad.replace_schema_metadata(new_meta), tmp_path / "bad.parquet")
    with pytest.raises(ResultsFileError, match="do not match the digest"):
        read_results(tmp_path / "bad.parquet")

    t.to_pandas().to_parquet(tmp_path / "pandas.parquet")
    got = read_results(tmp_path / "pandas.parquet")
    assert not got.checked and got.table.num_rows == t.num_rows

    damaged = {SETTINGS_KEY: meta[SETTINGS_KEY], b"kvfleet.digesu": meta[DIGEST_KEY]}
    pq.write_table(t.replace_schema_metadata(damaged), tmp_path / "key.parquet")
    with pytest.raises(ResultsFileError, match=r"b'kvfleet\.digesu' is not one kvfleet writes"):
        read_results(tmp_path / "key.parquet")
