"""Bad rows (malformed JSON, an empty object, a missing column, a token outside the vocabulary):
under data.bad_rows=skip each is skipped and counted by reason, the stream of trainable rows is
the one of the same data without them (so a resume lands on the same row), more than
data.max_bad_fraction of them stops; under stop the first one stops, naming its row and line
(both counted from 1). The summary counts a small source whole, so a bad row late in it is found
before the start. A format is guessed from the columns, and a column error names the format the
columns are in."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers.files import word_tokenizer
from megatrain_ray.config import DataConfig
from megatrain_ray.data import DataError, DataPosition, build_dataset
from megatrain_ray.data.bad_rows import BadRowCount
from megatrain_ray.data.summary import summarize

VOCAB = 64
WORDS = ["[UNK]", "</s>", "###", "User", "Assistant", ":", "hello", "yes"]


@pytest.fixture
def tokenizer_path(tmp_path: Path) -> str:
    return word_tokenizer(tmp_path, {w: i for i, w in enumerate(WORDS)})


def token_rows(n: int) -> list[dict]:
    return [{"input_ids": [(7 * i + j) % VOCAB for j in range(2 + i % 5)]} for i in range(n)]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def with_bad_lines(rows: list[dict], bad: dict[int, str]) -> list[str]:
    """JSON lines of `rows`, the line `bad[k]` put in before row k."""
    lines = []
    for i, row in enumerate(rows):
        if i in bad:
            lines.append(bad[i])
        lines.append(json.dumps(row))
    return lines


BAD = {3: "{}", 10: '{"input_ids": [1, 2', 17: '{"input_ids": [1, 99]}', 25: "[1, 2]"}
REASONS = {"missing column 'input_ids'": 1, "malformed JSON": 1, "token id outside the vocabulary": 1,
           "not a JSON object": 1}


def stream(cfg: DataConfig, steps: int, start: DataPosition | None = None, count: BadRowCount | None = None):
    batches = build_dataset(cfg, VOCAB, seed=0).batches(2, 2, start, count)
    return [next(batches) for _ in range(steps)]


def same(a, b) -> bool:
    """The same steps: as many, each with as many micro-batches, each with the same arrays."""
    if len(a) != len(b) or any(len(mx) != len(my) for (mx, _), (my, _) in zip(a, b, strict=True)):
        return False
    return all(x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
               for (mx, _), (my, _) in zip(a, b, strict=True) for x, y in zip(mx, my, strict=True))


def test_bad_rows_are_skipped_counted_and_the_stream_is_that_of_the_clean_data(tmp_path):
    rows = token_rows(40)
    dirty = write_lines(tmp_path / "dirty.jsonl", with_bad_lines(rows, BAD))
    clean = write_lines(tmp_path / "clean.jsonl", [json.dumps(r) for r in rows])
    cfg = DataConfig(source=str(dirty), seq_len=8, shuffle=False)
    assert same(stream(cfg, 12), stream(dataclasses.replace(cfg, source=str(clean)), 12))  # two epochs and more
    count = BadRowCount(0.1)
    stream(cfg, 4, count=count)  # within the first epoch, past its last bad row
    assert count.by_reason == REASONS
    assert count.first.startswith(f"{dirty} row 4 (line 4, counting from 1): missing column 'input_ids' (has: nothing)")

    # Shuffled: a resume from any step's position continues with the very batches of the whole stream.
    shuffled = dataclasses.replace(cfg, shuffle=True, shuffle_buffer=8)
    whole = stream(shuffled, 12)
    resumed = stream(shuffled, 7, start=whole[4][1])
    assert same(whole[5:], resumed) and [p for _, p in whole[5:]] == [p for _, p in resumed]


def test_under_stop_the_first_bad_row_stops_naming_row_and_line(tmp_path):
    dirty = write_lines(tmp_path / "dirty.jsonl", with_bad_lines(token_rows(40), BAD))
    cfg = DataConfig(source=str(dirty), seq_len=8, shuffle=False, bad_rows="stop")
    with pytest.raises(DataError, match=r"dirty\.jsonl row 4 \(line 4, counting from 1\): missing column 'input_ids'"):
        stream(cfg, 12)
    with pytest.raises(DataError, match=r"row 4 \(line 4, counting from 1\)"):
        summarize(build_dataset(cfg, VOCAB, seed=0))


def test_more_bad_rows_than_the_cap_stop_the_stream_and_are_refused_by_the_summary(tmp_path):
    rows = token_rows(300)
    bad = {i: "{}" for i in range(0, 300, 50)}  # 6 of 306 rows: 2%
    dirty = write_lines(tmp_path / "dirty.jsonl", with_bad_lines(rows, bad))
    cfg = DataConfig(source=str(dirty), seq_len=8, shuffle=False, max_bad_fraction=0.01)
    with pytest.raises(DataError, match=r"306 rows read, 6 of them bad \(6 missing column .input_ids.\): more than "
                                        r"data\.max_bad_fraction=0\.01 allows here, 3 bad rows \(0\.01 of the 306 rows "
                                        r"read\)\. The first 3 bad rows: .*row 1 \(line 1.*; .*row 52 \(line 52.*; .*row 103 "
                                        r"\(line 103"):
        summarize(build_dataset(cfg, VOCAB, seed=0))
    with pytest.raises(DataError, match=r"data\.max_bad_fraction=0\.01"):  # its second bad row, within 100 rows
        stream(cfg, 200, count=BadRowCount(0.01))
    # 2% passes a cap of 5%, and one bad row in a small file passes the default cap (1% of at least 100 rows)
    counted = summarize(build_dataset(dataclasses.replace(cfg, max_bad_fraction=0.05), VOCAB, seed=0))
    assert counted.rows_bad == {"missing column 'input_ids'": 6} and "6 bad rows skipped" in counted.describe()
    assert "\n  ... and 3 more bad rows" in counted.describe()
    small = write_lines(tmp_path / "small.jsonl", with_bad_lines(token_rows(20), {5: "{}"}))
    summarize(build_dataset(dataclasses.replace(cfg, source=str(small), max_bad_fraction=0.01), VOCAB, seed=0))


def test_the_summary_reads_a_small_source_whole_and_finds_a_late_bad_row(tmp_path):
    """A bad row at row 11,001 of 12,000: past the first 10,000 rows that the summary once read."""
    rows = token_rows(12_000)
    dirty = write_lines(tmp_path / "late.jsonl", with_bad_lines(rows, {11_000: "{}"}))
    summary = summarize(build_dataset(DataConfig(source=str(dirty), seq_len=8), VOCAB, seed=0))
    assert summary.complete and summary.rows_read == 12_001
    assert summary.rows_bad == {"missing column 'input_ids'": 1}
    assert "12,001 rows read (all of it)" in summary.describe()
    with pytest.raises(DataError, match=r"row 11001 \(line 11001, counting from 1\)"):
        summarize(build_dataset(DataConfig(source=str(dirty), seq_len=8, bad_rows="stop"), VOCAB, seed=0))


def test_an_empty_first_row_does_not_refuse_the_dataset(tmp_path, tokenizer_path):
    rows = [{"instruction": "hello", "output": "yes"}] * 5
    source = write_lines(tmp_path / "a.jsonl", ["{}"] + [json.dumps(r) for r in rows])
    dataset = build_dataset(DataConfig(source=str(source), tokenizer=tokenizer_path, seq_len=12), 20, seed=0)
    assert dataset.format == "alpaca"
    summary = summarize(dataset)
    assert summary.rows_trainable == 5 and summary.rows_bad == {"missing column 'instruction'": 1}


def test_the_format_is_guessed_from_the_columns_and_column_errors_name_it(tmp_path, tokenizer_path):
    chats = [{"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "yes"}]}] * 3
    source = write_lines(tmp_path / "chat.jsonl", [json.dumps(r) for r in chats])
    cfg = DataConfig(source=str(source), tokenizer=tokenizer_path, seq_len=12)
    assert build_dataset(cfg, 20, seed=0).format == "sharegpt"
    messages = write_lines(tmp_path / "messages.jsonl", [json.dumps({"messages": [
        {"role": "user", "content": "hello"}, {"role": "assistant", "content": "yes"}]})])
    assert build_dataset(dataclasses.replace(cfg, source=str(messages)), 20, seed=0).format == "sharegpt"
    # ShareGPT rows with an alpaca format pinned: every row is bad, and the message names the format
    pinned = dataclasses.replace(cfg, format="alpaca")
    with pytest.raises(DataError, match=r"missing column 'instruction' \(has: conversations\); these columns are "
                                        r"format sharegpt, and the source is read as alpaca \(data\.format"):
        summarize(build_dataset(pinned, 20, seed=0))
    table = pa.table({"text": ["hello yes"]})
    pq.write_table(table, tmp_path / "t.parquet")
    with pytest.raises(DataError, match=r"t\.parquet: missing column 'input_ids' \(has: text\); these columns are "
                                        r"format text: set it with --set data\.format=text"):
        summarize(build_dataset(DataConfig(source=str(tmp_path / "t.parquet"), format="tokens"), 20, seed=0))


def test_a_small_file_of_mixed_formats_is_refused_saying_where_and_why(tmp_path, tokenizer_path):
    """Six rows, two of them in another format than the first row's: the cap's message counts what
    a small file is allowed (not "of at least 100 rows"), names both rows and says that a source
    holds one format; with the cap raised, the summary names the format it told from the columns,
    the chat template, and where the bad rows are."""
    alpaca = {"instruction": "hello", "output": "yes"}
    chat = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "yes"}]}
    source = write_lines(tmp_path / "mixed.jsonl", [json.dumps(r) for r in [alpaca] * 3 + [chat] * 2 + [alpaca]])
    cfg = DataConfig(source=str(source), tokenizer=tokenizer_path, seq_len=12, chat_template="fallback")
    with pytest.raises(DataError) as refused:
        summarize(build_dataset(cfg, 20, seed=0))
    message = str(refused.value)
    assert ("6 rows read, 2 of them bad (2 missing column 'instruction'): more than data.max_bad_fraction=0.01 allows "
            "here, 1 bad row (0.01 of 100 rows: fewer rows read count as 100)") in message
    assert "of at least 100 rows" not in message
    for row in (4, 5):
        assert (f"{source} row {row} (line {row}, counting from 1): missing column 'instruction' (has: messages); "
                f"these columns are format sharegpt, and the source is read as alpaca") in message
    assert "one source holds rows of one format" in message

    summary = summarize(build_dataset(dataclasses.replace(cfg, max_bad_fraction=0.5), 20, seed=0)).describe()
    first, *located = summary.splitlines()
    assert ("6 rows read (all of it), 2 bad rows skipped (2 missing column 'instruction'), 0 truncated at "
            "data.seq_len; 4 trainable rows") in first and "none skipped" not in first
    assert first.endswith("; format alpaca (told from the first row's columns), the fallback chat template")
    assert [line.split(": missing column")[0] for line in located] == [
        f"  bad row: {source} row {row} (line {row}, counting from 1)" for row in (4, 5)]
    pinned = summarize(build_dataset(dataclasses.replace(cfg, source=str(write_lines(
        tmp_path / "one.jsonl", [json.dumps(alpaca)] * 3)), format="alpaca"), 20, seed=0)).describe()
    assert "none skipped" in pinned and pinned.endswith("; format alpaca (data.format), the fallback chat template")


def test_one_bad_row_is_not_said_to_be_none_skipped(tmp_path):
    source = write_lines(tmp_path / "rows.jsonl", with_bad_lines(token_rows(20), {5: "{}"}))
    summary = summarize(build_dataset(DataConfig(source=str(source), seq_len=8), VOCAB, seed=0)).describe()
    assert "20 rows read" not in summary and "21 rows read (all of it), 1 bad row skipped (1 missing column" in summary
    assert "none skipped" not in summary and "format tokens (told from the first row's columns)" in summary
    assert f"\n  bad row: {source} row 6 (line 6, counting from 1): missing column 'input_ids'" in summary
