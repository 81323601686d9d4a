"""JSONL / Parquet / list sources: random access, thread safety, pickling, Grain use."""

import json
import pickle
from concurrent.futures import ThreadPoolExecutor

import grain
import pytest

from ptrain.data import ArrowSource, JsonlSource, ListSource, ParquetSource, open_source
from ptrain.data.sources import RowDecodeError

ROWS = [
    {
        "messages": [{"role": "user", "content": f"q{i} " + "x" * (i % 37)}, {"role": "assistant", "content": f"a{i}"}],
        "id": i,
    }
    for i in range(300)
]


@pytest.fixture(scope="module")
def jsonl_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / "rows.jsonl"
    with open(path, "w") as f:
        for i, r in enumerate(ROWS):
            f.write(json.dumps(r) + "\n")
            if i == 5:
                f.write("\n")  # blank lines are not rows
    return str(path)


@pytest.fixture(scope="module")
def parquet_path(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path_factory.mktemp("src") / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), str(path), row_group_size=64)
    return str(path)


def test_jsonl_random_access_and_line_numbers(jsonl_path):
    src = JsonlSource(jsonl_path)
    assert len(src) == len(ROWS)
    assert src[0] == ROWS[0] and src[299] == ROWS[299] and src[6] == ROWS[6]
    assert src.line_number(5) == 6 and src.line_number(6) == 8  # the blank line 7 is skipped
    assert "row 6 (line 8)" in src.where(6)


def test_jsonl_is_thread_safe(jsonl_path):
    """Many threads reading random rows at once (Grain's read pool) get exactly their rows."""
    src = JsonlSource(jsonl_path)
    order = [(i * 7919) % len(ROWS) for i in range(3000)]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: src[i]["id"], order))
    assert got == order


def test_jsonl_pickles(jsonl_path):
    src = pickle.loads(pickle.dumps(JsonlSource(jsonl_path)))
    assert src[17] == ROWS[17]


def test_jsonl_bad_json_raises_row_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": 1}\n{not json\n[1, 2]\n')
    src = JsonlSource(str(path))
    assert src[0] == {"a": 1}
    with pytest.raises(RowDecodeError, match="invalid JSON"):
        src[1]
    with pytest.raises(RowDecodeError, match="JSON object"):
        src[2]


def test_parquet_nested_rows(parquet_path):
    src = ParquetSource(parquet_path)
    assert len(src) == len(ROWS)
    assert src[0] == ROWS[0] and src[200] == ROWS[200]
    with pytest.raises(IndexError):
        src[len(ROWS)]


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_grain_reads_sources_with_threads(kind, jsonl_path, parquet_path):
    src = open_source(jsonl_path if kind == "jsonl" else parquet_path)
    ds = grain.MapDataset.source(src).shuffle(0).map(lambda r: r["id"])
    got = list(ds.to_iter_dataset(grain.ReadOptions(num_threads=8, prefetch_buffer_size=64)))
    assert sorted(got) == list(range(len(ROWS)))
    assert got == [ds[i] for i in range(len(ds))]


def test_missing_file_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        JsonlSource(str(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        ParquetSource(str(tmp_path / "nope.parquet"))


def test_corrupt_arrow_file_error_names_the_file(tmp_path):
    path = tmp_path / "data-00000-of-00001.arrow"
    path.write_bytes(b"not arrow at all" * 8)
    with pytest.raises(ValueError, match="data-00000-of-00001.arrow is neither an Arrow stream nor an Arrow file"):
        open_source(str(path))[0]


def test_list_source():
    src = ListSource(ROWS[:3], name="mem")
    assert len(src) == 3 and src[2] == ROWS[2] and src.where(1) == "mem row 1"


def test_jsonl_tolerates_a_byte_order_mark_and_crlf(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}\r\n{"a": 2}\r\n')
    src = JsonlSource(str(path))
    assert [src[0], src[1]] == [{"a": 1}, {"a": 2}]


@pytest.mark.parametrize("form", ["folder", "glob"])
def test_parquet_shards_read_in_name_order(form, tmp_path):
    """Hugging Face's sharded layout: train-00000-of-00003.parquet, ... read as one source."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path / "shards"
    d.mkdir()
    for k, lo in enumerate((0, 100, 250)):
        hi = (100, 250, 300)[k]
        pq.write_table(pa.Table.from_pylist(ROWS[lo:hi]), str(d / f"train-{k:05d}-of-00003.parquet"))
    (d / "README.md").write_text("not data")
    src = ParquetSource(str(d) if form == "folder" else str(d / "train-*.parquet"))
    assert len(src) == 300 and [src[i]["id"] for i in (0, 99, 100, 299)] == [0, 99, 100, 299]
    assert src.where(120).endswith("train-00001-of-00003.parquet row 20 (row 120 overall)")


def test_parquet_nothing_matches(tmp_path):
    with pytest.raises(FileNotFoundError, match="no parquet data"):
        ParquetSource(str(tmp_path / "train-*.parquet"))


@pytest.mark.parametrize("fmt", ["stream", "file"])
def test_arrow_save_to_disk_folder(fmt, tmp_path):
    """A `datasets` save_to_disk / cache folder: Arrow IPC shards next to JSON metadata."""
    import pyarrow as pa

    d = tmp_path / "ds"
    d.mkdir()
    for k, (lo, hi) in enumerate(((0, 120), (120, 300))):
        table = pa.Table.from_pylist(ROWS[lo:hi])
        new = pa.ipc.new_stream if fmt == "stream" else pa.ipc.new_file
        with pa.OSFile(str(d / f"data-{k:05d}-of-00002.arrow"), "wb") as sink, new(sink, table.schema) as w:
            w.write_table(table)
    listed = {"_data_files": [{"filename": f"data-{k:05d}-of-00002.arrow"} for k in range(2)]}
    (d / "state.json").write_text(json.dumps(listed))
    (d / "dataset_info.json").write_text("{}")
    stray = pa.Table.from_pylist(ROWS[:5])  # a .map cache next to the shards: not rows of the dataset
    with pa.OSFile(str(d / "cache-0123abcd.arrow"), "wb") as sink, pa.ipc.new_stream(sink, stray.schema) as w:
        w.write_table(stray)
    src = ArrowSource(str(d))
    assert len(src) == 300 and src[0] == ROWS[0] and src[150] == ROWS[150]
    assert open_source(str(d / "data-00001-of-00002.arrow"))[0] == ROWS[120]
