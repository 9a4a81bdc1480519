"""CSV source: column selection, random access, quoting, the bad-row policy and bounded memory."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from loaders import CSVSource, LoaderError

REPO = Path(__file__).resolve().parents[1]


def _write(path: Path, text: str) -> Path:
    path.write_bytes(text.encode())
    return path


def test_columns_by_name_and_index_and_random_access(tmp_path: Path, closing) -> None:
    rng = np.random.default_rng(0)
    values = rng.integers(-500, 500, (50, 4)) / 8.0  # exact in float32
    labels = rng.integers(0, 3, 50)
    lines = ["a,b,target,c,d"] + [
        f"{r[0]},{r[1]},{lab},{r[2]},{r[3]}" for r, lab in zip(values, labels, strict=True)
    ]
    path = _write(tmp_path / "t.csv", "\n".join(lines) + "\n")
    src = closing(CSVSource(path, label_column="target", chunk_rows=7))
    assert len(src) == 50 and src.sample_shape == (4,) and src.num_classes == 3
    assert src.label_dtype == np.int32 and src.labels.tolist() == labels.tolist()
    order = [49, 3, 3, 17, 0, 18, 19, 20]
    x, y, skipped = src.read(order)
    assert skipped == 0
    np.testing.assert_array_equal(x, values[order].astype(np.float32))
    np.testing.assert_array_equal(y, labels[order])
    picked = closing(CSVSource(path, label_column=2, feature_columns=("d", 0)))
    np.testing.assert_array_equal(picked.read([5])[0], values[[5]][:, [3, 0]].astype(np.float32))
    x_all, _, _ = src.read(range(50))
    np.testing.assert_array_equal(x_all, values.astype(np.float32))
    assert src.statistics().samples_read == 58


def test_no_header_crlf_blank_lines_bom_and_no_final_newline(tmp_path: Path, closing) -> None:
    path = tmp_path / "raw.csv"
    path.write_bytes(b"\xef\xbb\xbf1.5,2,0\r\n\r\n3,4.25,1\r\n\n5,6,1")
    src = closing(CSVSource(path, label_column=-1, header=False))
    assert len(src) == 3 and src.columns == ["column 0", "column 1", "column 2"]
    x, y, _ = src.read([0, 1, 2])
    np.testing.assert_array_equal(x, [[1.5, 2], [3, 4.25], [5, 6]])
    assert y.tolist() == [0, 1, 1]
    with pytest.raises(LoaderError, match="no header"):
        CSVSource(path, label_column="label", header=False)


def test_quoted_fields_with_commas_and_newlines(tmp_path: Path, closing) -> None:
    text = 'x,note,y,label\n1,"a, b",2,cat\n3,"two\nlines",4,dog\n5,"say ""hi""",6,cat\n'
    src = closing(
        CSVSource(_write(tmp_path / "q.csv", text), label_column="label", feature_columns=("x", "y"))
    )
    assert len(src) == 3 and src.classes == ["cat", "dog"]
    x, y, _ = src.read([2, 1, 0])
    np.testing.assert_array_equal(x, [[5, 6], [3, 4], [1, 2]])
    assert y.tolist() == [0, 1, 0]


def test_label_kinds_names_regression_and_task_override(tmp_path: Path, closing) -> None:
    names = closing(CSVSource(_write(tmp_path / "n.csv", "f,l\n1,pear\n2,apple\n3,pear\n"), label_column="l"))
    assert (
        names.classes == ["apple", "pear"] and names.labels.tolist() == [1, 0, 1] and names.num_classes == 2
    )
    reg = closing(CSVSource(_write(tmp_path / "r.csv", "f,l\n1,0.5\n2,-1.25\n"), label_column="l"))
    assert reg.label_dtype == np.float32 and reg.num_classes is None and reg.labels.tolist() == [0.5, -1.25]
    forced = closing(
        CSVSource(_write(tmp_path / "i.csv", "f,l\n1,3\n2,7\n"), label_column="l", task="regression")
    )
    assert forced.label_dtype == np.float32 and forced.num_classes is None


def test_bad_feature_value_names_row_line_column_and_value(tmp_path: Path, closing) -> None:
    text = "a,b,label\n1,2,0\n3,4,1\n5,oops,0\n7,8,1\n"
    src = closing(CSVSource(_write(tmp_path / "bad.csv", text), label_column="label"))
    with pytest.raises(LoaderError) as info:
        src.read(range(4))
    msg = str(info.value)
    assert "bad.csv" in msg and "row 2" in msg and "line 4" in msg and "'b'" in msg and "'oops'" in msg
    np.testing.assert_array_equal(src.read([0, 1, 3])[0], [[1, 2], [3, 4], [7, 8]])


def _open_and_read_every_row(path: Path) -> None:
    """Open the file and read every row: a bad row is found at open or when read, by its kind."""
    with CSVSource(path, label_column="label") as src:
        src.read(range(len(src)))


@pytest.mark.parametrize(
    "row, why",
    [
        ("5,,0", "column 'b': cannot parse ''"),
        ("5,6,0,9", "expected 3 columns, got 4"),
        ("5,nan,0", "column 'b': value 'nan' is not finite"),
        ("5,6", "too few columns to hold the label column 'label'"),  # found at open
        ("5,6,x", "column 'label': bad label 'x'"),  # found at open
        ('5,"6,0', "cannot parse row"),  # unterminated quote: found at open
    ],
)
def test_each_kind_of_bad_row_is_named(tmp_path: Path, row: str, why: str) -> None:
    path = _write(tmp_path / "b.csv", f"a,b,label\n1,2,0\n{row}\n3,4,1\n")
    with pytest.raises(LoaderError, match=r"b\.csv: (row 1 \()?line 3\)?") as info:
        _open_and_read_every_row(path)
    assert why in info.value.why


def test_bad_rows_are_skipped_counted_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, closing
) -> None:
    rows = ["a,b,label"] + [f"{i},{i * 2},{i % 2}" for i in range(20)]
    rows[4] = "3,x,1"
    rows[9] = "8,16,0,99"
    rows[15] = "14,28,-3"  # bad label: found while indexing at open
    path = _write(tmp_path / "s.csv", "\n".join(rows) + "\n")
    with caplog.at_level(logging.WARNING, logger="vkflow.loaders"):
        src = closing(CSVSource(path, label_column="label", on_error="skip", chunk_rows=4))
        assert len(src) == 19
        x, y, skipped = src.read(range(19))
    assert skipped == 2 and x.shape == (17, 2)
    expected = [i for i in range(20) if i not in (3, 8, 14)]
    np.testing.assert_array_equal(x[:, 0], expected)
    np.testing.assert_array_equal(y, [i % 2 for i in expected])
    assert src.statistics().skipped == 3
    src.read(range(19))  # again: each bad row is met twice but counts once as an item
    stats = src.statistics()
    assert stats.skipped == 5 and stats.skipped_items == 3
    assert stats.skipped_examples == (f"{path}: line 16", f"{path}: row 3", f"{path}: row 8")
    assert len([r for r in caplog.records if r.name == "vkflow.loaders"]) == 1
    with pytest.raises(
        LoaderError, match=r"line 16: column 'label': bad label '-3' \(negative class label\)"
    ):
        CSVSource(path, label_column="label")


def test_missing_columns_and_files_are_loader_errors(tmp_path: Path) -> None:
    path = _write(tmp_path / "c.csv", "a,b\n1,2\n")
    with pytest.raises(LoaderError, match="no column 'z'"):
        CSVSource(path, label_column="z")
    with pytest.raises(LoaderError, match="cannot open"):
        CSVSource(tmp_path / "none.csv", label_column=0)
    with pytest.raises(LoaderError, match="h.csv: no data rows under the header"):
        CSVSource(_write(tmp_path / "h.csv", "a,b\n"), label_column="a")
    with pytest.raises(LoaderError, match="e.csv: empty file: no header and no data rows"):
        CSVSource(_write(tmp_path / "e.csv", "\n\n"), label_column=0, header=False)
    with pytest.raises(LoaderError, match="no data rows left: all 2 had a bad label and were skipped"):
        CSVSource(_write(tmp_path / "x.csv", "a,b\n1,-1\n2,x\n"), label_column="b", on_error="skip")


_MEASURE = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[2])
    from loaders import CSVSource

    def peak_kb():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM"):
                return int(line.split()[1])

    def reset_peak():
        # Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS.
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    try:
        reset_peak()
    except OSError:
        print("unsupported")
        sys.exit(0)
    before = peak_kb()
    src = CSVSource(sys.argv[1], label_column="label", chunk_rows=2048)
    total, checksum = 0, 0.0
    for lo in range(0, len(src), 2048):
        x, y, _ = src.read(range(lo, min(lo + 2048, len(src))))
        total += len(x)
        checksum += float(x[:, 0].sum())
    streamed = peak_kb() - before
    # Control: the same measure must see a whole-file read, or it proves nothing.
    reset_peak()
    before = peak_kb()
    whole = open(sys.argv[1], "rb").read()
    control = peak_kb() - before
    print(len(src), total, checksum, streamed, control)
    """
)


def test_large_file_streams_in_bounded_memory(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    block_rows = 2000
    block = rng.standard_normal((block_rows, 16))
    body = "\n".join(",".join(f"{v:.7f}" for v in r) + f",{i % 10}" for i, r in enumerate(block)) + "\n"
    path = tmp_path / "big.csv"
    repeats = 0
    with open(path, "w") as f:
        f.write(",".join(f"f{j}" for j in range(16)) + ",label\n")
        while f.tell() < 50_000_000:
            f.write(body)
            repeats += 1
    size = os.path.getsize(path)
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(path), str(REPO)], capture_output=True, text=True, check=True
    )
    if out.stdout.strip() == "unsupported":
        pytest.skip("peak RSS cannot be reset here (needs Linux /proc/self/clear_refs)")
    n, total, checksum, streamed_kb, control_kb = out.stdout.split()
    assert int(n) == int(total) == block_rows * repeats
    np.testing.assert_allclose(float(checksum), repeats * block[:, 0].astype(np.float32).sum(), rtol=1e-4)
    assert int(control_kb) * 1024 > 0.9 * size
    # The index costs 16 bytes a row (start, length, label: ~4.7 MB here) plus a few buffers of
    # 256 KiB; reading the file whole would cost its 50 MB, as the control shows.
    rows = block_rows * repeats
    assert int(streamed_kb) * 1024 < min(16 * rows + (6 << 20), size / 4), (streamed_kb, size)
