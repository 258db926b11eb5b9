"""The data pipeline: formats, label shift, SFT masks, packing, determinism, resume, errors."""

import itertools
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from megatrain_ray.config import DataConfig, EvalConfig
from megatrain_ray.data import IGNORE_INDEX, DataError, DataPosition, build_dataset, build_datasets
from helpers.files import word_tokenizer, write_jsonl

WORDS = ["[UNK]", "</s>", "###", "User", "Assistant", "System", ":", "hello", "world", "the", "cat", "sat",
         "on", "mat", "what", "is", "two", "plus", "four", "be", "nice", "yes", "no", "ok"]
VOCAB = {w: i for i, w in enumerate(WORDS)}
EOS = VOCAB["</s>"]


@pytest.fixture
def tokenizer_path(tmp_path: Path) -> str:
    return word_tokenizer(tmp_path, VOCAB)


def ids(text: str) -> list[int]:
    return [VOCAB[w] for w in text.replace(":", " : ").split()]


def write_parquet(path: Path, columns: dict, row_group_size: int | None = None) -> Path:
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


def take(dataset, steps: int, micro: int = 1, accum: int = 1, start=None):
    return list(itertools.islice(dataset.batches(micro, accum, start), steps))


def flat_rows(steps) -> list[dict]:
    return [{k: mb[k][b] for k in mb} for batch, _ in steps for mb in batch for b in range(len(mb["input_ids"]))]


def same(a, b) -> bool:
    """As many steps, as many rows, each row's arrays the same."""
    rows_a, rows_b = flat_rows(a), flat_rows(b)
    return len(a) == len(b) and len(rows_a) == len(rows_b) and all(
        x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(rows_a, rows_b, strict=True))


# ------------------------------------------------------------------ synthetic


def test_synthetic_shapes_dtypes_and_determinism():
    cfg = DataConfig(seq_len=32)
    steps = take(build_dataset(cfg, 1000, seed=3), 3, micro=2, accum=3)
    for batch, _ in steps:
        assert len(batch) == 3
        for mb in batch:
            assert set(mb) == {"input_ids", "labels", "position_ids"}
            for v in mb.values():
                assert v.dtype == np.int64 and v.shape == (2, 32)
            assert mb["input_ids"].min() >= 0 and mb["input_ids"].max() < 1000
    assert [p for _, p in steps] == [DataPosition(0, 6), DataPosition(0, 12), DataPosition(0, 18)]
    assert same(steps, take(build_dataset(cfg, 1000, seed=3), 3, micro=2, accum=3))
    assert not same(steps, take(build_dataset(cfg, 1000, seed=4), 3, micro=2, accum=3))


def test_synthetic_labels_are_next_tokens_within_each_document():
    for row in flat_rows(take(build_dataset(DataConfig(seq_len=64), 500, seed=0), 4, micro=2)):
        check_shift(row)


def check_shift(row: dict) -> None:
    """Within a document, labels[t] == input_ids[t+1] unless masked; a document's last position is -100.
    (The row's last position may hold the target of a document that goes on in the next row.)"""
    inp, lab, pos = row["input_ids"], row["labels"], row["position_ids"]
    for t in range(len(inp) - 1):
        if lab[t] != IGNORE_INDEX:
            assert pos[t + 1] != 0 and lab[t] == inp[t + 1]
        elif pos[t + 1] != 0:
            assert inp[t + 1] == 0 or t + 1 == len(inp)  # only padding follows an untrained position


def test_synthetic_data_is_learnable():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    vocab, dim = 512, 64
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, vocab))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for batch, _ in take(build_dataset(DataConfig(seq_len=64), vocab, seed=0), 20, micro=4):
        mb = batch[0]
        logits = model(torch.from_numpy(mb["input_ids"]))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.from_numpy(mb["labels"]).flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.5, losses


# ------------------------------------------------------------------ pre-tokenized files


def test_tokens_parquet_unpacked_rows_are_shifted_and_padded(tmp_path):
    docs = [[5, 6, 7], [8, 9], [1, 2, 3, 4, 5, 6]]
    write_parquet(tmp_path / "d.parquet", {"input_ids": docs})
    cfg = DataConfig(source=str(tmp_path / "d.parquet"), seq_len=6, pack=False, shuffle=False)
    rows = flat_rows(take(build_dataset(cfg, 10, seed=0), 3))
    for doc, row in zip(docs, rows, strict=True):
        n = len(doc)
        assert row["input_ids"].tolist() == doc + [0] * (6 - n)
        assert row["labels"].tolist() == doc[1:] + [IGNORE_INDEX] * (7 - n)
        assert row["position_ids"].tolist() == list(range(6))


def test_labels_and_loss_mask_columns(tmp_path):
    write_parquet(tmp_path / "a.parquet", {
        "input_ids": [[1, 2, 3, 4], [5, 6, 7, 8]],
        "labels": [[-100, -100, 3, 4], None],
        "loss_mask": [[1, 1, 1, 1], [0, 0, 1, 0]],
    })
    cfg = DataConfig(source=str(tmp_path / "a.parquet"), seq_len=4, pack=False, shuffle=False)
    rows = flat_rows(take(build_dataset(cfg, 10, seed=0), 2))
    assert rows[0]["labels"].tolist() == [-100, 3, 4, -100]  # labels win over loss_mask
    assert rows[1]["labels"].tolist() == [-100, 7, -100, -100]  # loss_mask on token 7: predicted from position 1


def test_arrow_file_and_stream_and_jsonl_tokens_agree(tmp_path):
    docs = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    table = pa.table({"input_ids": docs})
    feather.write_feather(table, tmp_path / "f.arrow")
    with pa.OSFile(str(tmp_path / "s.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=1)
    write_jsonl(tmp_path / "j.jsonl", [{"input_ids": d} for d in docs])
    results = []
    for name in ("f.arrow", "s.arrow", "j.jsonl"):
        cfg = DataConfig(source=str(tmp_path / name), seq_len=8, shuffle=False, read_batch_rows=2)
        results.append(take(build_dataset(cfg, 10, seed=0), 2))
    assert same(results[0], results[1]) and same(results[0], results[2])
    first = flat_rows(results[0])[0]
    assert first["input_ids"].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert first["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 0]


def test_packing_restarts_positions_and_splits_long_documents(tmp_path):
    docs = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 1, 2, 3], [7, 8]]
    write_parquet(tmp_path / "d.parquet", {"input_ids": docs})
    cfg = DataConfig(source=str(tmp_path / "d.parquet"), seq_len=5, pack=True, shuffle=False)
    rows = flat_rows(take(build_dataset(cfg, 10, seed=0), 3))
    assert [r["input_ids"].tolist() for r in rows] == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 1], [2, 3, 7, 8, 0]]
    assert [r["position_ids"].tolist() for r in rows] == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 4], [0, 1, 0, 1, 2]]
    # a document's last position has no target; a split document keeps its cross-row target
    assert [r["labels"].tolist() for r in rows] == [[2, 3, -100, 5, 6], [7, 8, 9, 1, 2], [3, -100, 8, -100, -100]]


def test_unpacked_long_documents_split_into_chunks_with_truncate(tmp_path):
    write_parquet(tmp_path / "d.parquet", {"input_ids": [[1, 2, 3, 4, 5, 6, 7]]})
    cfg = DataConfig(source=str(tmp_path / "d.parquet"), seq_len=4, pack=False, shuffle=False)
    rows = flat_rows(take(build_dataset(cfg, 10, seed=0), 2))
    assert [r["input_ids"].tolist() for r in rows] == [[1, 2, 3, 4], [5, 6, 7, 0]]
    assert [r["labels"].tolist() for r in rows] == [[2, 3, 4, 5], [6, 7, -100, -100]]


# ------------------------------------------------------------------ text and SFT


def test_text_jsonl_is_tokenized_with_eos(tmp_path, tokenizer_path):
    write_jsonl(tmp_path / "t.jsonl", [{"body": "hello world"}, {"body": "the cat sat"}])
    cfg = DataConfig(source=str(tmp_path / "t.jsonl"), tokenizer=tokenizer_path, text_column="body",
                     seq_len=8, pack=False, shuffle=False)
    rows = flat_rows(take(build_dataset(cfg, len(WORDS), seed=0), 2))
    assert rows[0]["input_ids"].tolist()[:3] == ids("hello world") + [EOS]
    assert rows[0]["labels"].tolist()[:3] == ids("world") + [EOS, IGNORE_INDEX]
    assert rows[1]["input_ids"].tolist()[:4] == ids("the cat sat") + [EOS]


def test_text_parquet_with_eos_override(tmp_path, tokenizer_path):
    write_parquet(tmp_path / "t.parquet", {"text": ["hello world", "yes"]})
    cfg = DataConfig(source=str(tmp_path / "t.parquet"), tokenizer=tokenizer_path, eos_token_id=VOCAB["ok"],
                     seq_len=6, shuffle=False)
    row = flat_rows(take(build_dataset(cfg, len(WORDS), seed=0), 1))[0]
    assert row["input_ids"].tolist() == ids("hello world ok yes ok") + [0]
    assert row["position_ids"].tolist() == [0, 1, 2, 0, 1, 2]


def trained_tokens(row: dict) -> list[int]:
    return [int(x) for x in row["labels"] if x != IGNORE_INDEX]


def test_alpaca_loss_covers_exactly_the_response(tmp_path, tokenizer_path):
    write_jsonl(tmp_path / "a.jsonl", [
        {"instruction": "what is two plus two", "input": "", "output": "four"},
        {"instruction": "be nice", "input": "the cat", "output": "yes ok"},
    ])
    cfg = DataConfig(source=str(tmp_path / "a.jsonl"), tokenizer=tokenizer_path, seq_len=32, pack=False, shuffle=False)
    dataset = build_dataset(cfg, len(WORDS), seed=0)
    assert dataset.format == "alpaca"
    rows = flat_rows(take(dataset, 2))
    first = ids("### User: what is two plus two ### Assistant: four </s>")
    assert rows[0]["input_ids"].tolist() == first + [0] * (32 - len(first))
    assert trained_tokens(rows[0]) == ids("four </s>")
    assert rows[1]["input_ids"].tolist()[:13] == ids("### User: be nice the cat ### Assistant: yes ok </s>")
    assert trained_tokens(rows[1]) == ids("yes ok </s>")
    # the labels sit one position before their tokens
    t = rows[1]["labels"].tolist().index(VOCAB["yes"])
    assert rows[1]["input_ids"][t] == VOCAB[":"] and rows[1]["input_ids"][t + 1] == VOCAB["yes"]


def test_alpaca_system_column_in_parquet(tmp_path, tokenizer_path):
    write_parquet(tmp_path / "a.parquet", {"instruction": ["hello"], "output": ["yes"], "system": ["be nice"]})
    cfg = DataConfig(source=str(tmp_path / "a.parquet"), tokenizer=tokenizer_path, seq_len=32, pack=False)
    row = flat_rows(take(build_dataset(cfg, len(WORDS), seed=0), 1))[0]
    expected = ids("### System: be nice ### User: hello ### Assistant: yes </s>")
    assert row["input_ids"].tolist()[:len(expected)] == expected
    assert trained_tokens(row) == ids("yes </s>")


@pytest.mark.parametrize("variant", ["conversations", "messages"])
def test_sharegpt_trains_every_assistant_turn_only(tmp_path, tokenizer_path, variant):
    turns = [("system", "be nice"), ("human", "hello"), ("gpt", "hello world"), ("human", "what is the cat"),
             ("gpt", "the cat sat")]
    if variant == "conversations":
        row = {"conversations": [{"from": r, "value": v} for r, v in turns]}
    else:
        names = {"system": "system", "human": "user", "gpt": "assistant"}
        row = {"messages": [{"role": names[r], "content": v} for r, v in turns]}
    write_jsonl(tmp_path / "c.jsonl", [row])
    cfg = DataConfig(source=str(tmp_path / "c.jsonl"), tokenizer=tokenizer_path, seq_len=40, pack=False)
    out = flat_rows(take(build_dataset(cfg, len(WORDS), seed=0), 1))[0]
    expected = ("### System: be nice ### User: hello ### Assistant: hello world </s> "
                "### User: what is the cat ### Assistant: the cat sat </s>")
    assert out["input_ids"].tolist()[:len(ids(expected))] == ids(expected)
    assert trained_tokens(out) == ids("hello world </s> the cat sat </s>")


def test_sharegpt_parquet_and_sft_truncation(tmp_path, tokenizer_path):
    conv = [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "yes ok yes ok"}]
    write_parquet(tmp_path / "c.parquet", {"conversations": [conv]})
    cfg = DataConfig(source=str(tmp_path / "c.parquet"), tokenizer=tokenizer_path, seq_len=9, pack=True)
    row = flat_rows(take(build_dataset(cfg, len(WORDS), seed=0), 1))[0]
    assert row["input_ids"].tolist() == ids("### User: hello ### Assistant: yes ok")
    assert trained_tokens(row) == ids("yes ok yes")  # the last position predicts the first cut token
    with pytest.raises(DataError, match=r"c\.parquet row 1 \(counting from 1\): 12 tokens, longer than data\.seq_len=9"):
        take(build_dataset(DataConfig(source=cfg.source, tokenizer=cfg.tokenizer, seq_len=9, truncate=False),
                           len(WORDS), seed=0), 1)


def test_sft_packing_starts_a_new_row_instead_of_splitting(tmp_path, tokenizer_path):
    write_jsonl(tmp_path / "a.jsonl", [{"instruction": "hello", "output": "yes"}] * 3)  # 9 tokens each
    cfg = DataConfig(source=str(tmp_path / "a.jsonl"), tokenizer=tokenizer_path, seq_len=20, shuffle=False)
    rows = flat_rows(take(build_dataset(cfg, len(WORDS), seed=0), 2))
    assert rows[0]["position_ids"].tolist() == list(range(9)) + list(range(11))
    assert rows[1]["position_ids"].tolist() == list(range(20))
    assert rows[1]["input_ids"].tolist() == ids("### User: hello ### Assistant: yes </s>") + [0] * 11
    assert trained_tokens(rows[0]) == ids("yes </s> yes </s>")


# ------------------------------------------------------------------ shuffling and resume


def many_docs(tmp_path: Path, files: int = 3, per_file: int = 20) -> str:
    for f in range(files):
        docs = [[(f * per_file + i) % 97 + 1] * (2 + i % 3) for i in range(per_file)]
        write_parquet(tmp_path / f"part-{f}.parquet", {"input_ids": docs}, row_group_size=7)
    return str(tmp_path / "*.parquet")


def test_shuffle_is_deterministic_per_seed_and_epoch(tmp_path):
    source = many_docs(tmp_path)
    cfg = DataConfig(source=source, seq_len=4, pack=False, shuffle_buffer=8, read_batch_rows=5)
    a = take(build_dataset(cfg, 100, seed=1), 120, micro=1)
    assert same(a, take(build_dataset(cfg, 100, seed=1), 120, micro=1))
    assert not same(a, take(build_dataset(cfg, 100, seed=2), 120, micro=1))
    rows = [r["input_ids"][0] for r in flat_rows(a)]
    assert rows[:60] != rows[60:] and sorted(rows[:60]) == sorted(rows[60:])  # reshuffled, same documents
    assert [p for _, p in a][59:61] == [DataPosition(0, 60), DataPosition(1, 1)]
    straight = take(build_dataset(DataConfig(source=source, seq_len=4, pack=False, shuffle=False), 100, seed=1), 120)
    in_order = [r["input_ids"][0] for r in flat_rows(straight)]
    assert in_order[:60] == in_order[60:] and in_order[:3] == [1, 2, 3]


@pytest.mark.parametrize("source", ["synthetic", "files"])
def test_resume_yields_exactly_what_a_straight_run_yields_next(tmp_path, source):
    cfg = DataConfig(source=many_docs(tmp_path) if source == "files" else "synthetic", seq_len=8,
                     shuffle_buffer=5, synthetic_docs=30)
    straight = take(build_dataset(cfg, 100, seed=7), 12, micro=2, accum=2)
    for k in (3, 5, 9):  # steps 5 and 9 are in the second and third epochs
        position = DataPosition.from_dict(json.loads(json.dumps(straight[k - 1][1].to_dict())))
        resumed = take(build_dataset(cfg, 100, seed=7), 12 - k, micro=2, accum=2, start=position)
        assert same(resumed, straight[k:])
        assert [p for _, p in resumed] == [p for _, p in straight[k:]]
    assert straight[-1][1].epoch >= 2


def epoch_documents(dataset, epoch: int = 0) -> list[int]:
    """many_docs documents by their (unique) first token."""
    return [int(d.input_ids[0]) for d in dataset.documents(epoch)]


def test_holdout_splits_rows_stably_and_disjointly(tmp_path):
    source = many_docs(tmp_path)  # 60 documents, each with its own first token
    whole = sorted(epoch_documents(build_dataset(DataConfig(source=source, seq_len=4, shuffle=False), 100, seed=0)))
    parts = {}
    for seed, shuffle in ((0, False), (3, True)):
        train, held = build_datasets(DataConfig(source=source, seq_len=4, shuffle=shuffle, shuffle_buffer=4),
                                     EvalConfig(holdout_fraction=0.25), 100, seed)
        kept = epoch_documents(train, epoch=1)
        out = epoch_documents(held)
        assert sorted(kept + out) == whole and not set(kept) & set(out)
        parts[seed] = (sorted(kept), out)
    assert parts[0] == (parts[3][0], parts[3][1])  # not the seed, not the order: the same rows held out
    assert 5 <= len(parts[0][1]) <= 25  # about a quarter of 60
    assert held.cfg.shuffle is False and "held out" in held.describe()


def test_validation_batches_are_fixed_and_bounded(tmp_path):
    source = many_docs(tmp_path)
    evaluation = tmp_path / "val"
    evaluation.mkdir()
    write_parquet(evaluation / "v.parquet", {"input_ids": [[7, 8, 9], [1, 2], [3, 4, 5]]})
    train, held = build_datasets(DataConfig(source=source, seq_len=4, pack=False), EvalConfig(source=str(evaluation)),
                                 100, seed=0)
    first, again = held.fixed_batches(2, 5), held.fixed_batches(2, 5)
    # the last filled with a row of padding to the step's shape: no target, positions as an unpacked row's
    assert [b["input_ids"].tolist() for b in first] == [[[7, 8, 9, 0], [1, 2, 0, 0]], [[3, 4, 5, 0], [0, 0, 0, 0]]]
    assert first[1]["labels"][1].tolist() == [IGNORE_INDEX] * 4 and first[1]["position_ids"][1].tolist() == [0, 1, 2, 3]
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(first, again, strict=True) for k in a)
    assert len(held.fixed_batches(1, 2)) == 2
    assert train.files != held.files
    with pytest.raises(DataError, match="eval.holdout_fraction needs data files"):
        build_datasets(DataConfig(), EvalConfig(holdout_fraction=0.1), 100, seed=0)


def test_directory_source_ignores_marker_files(tmp_path):
    many_docs(tmp_path, files=2, per_file=4)
    (tmp_path / "_SUCCESS").write_text("")
    (tmp_path / "README.md").write_text("not data")
    dataset = build_dataset(DataConfig(source=str(tmp_path), seq_len=4, pack=False, shuffle=False), 100, seed=0)
    assert [p.name for p in dataset.files] == ["part-0.parquet", "part-1.parquet"]
    assert len(flat_rows(take(dataset, 8))) == 8


# ------------------------------------------------------------------ errors


def test_missing_column_names_the_file(tmp_path, tokenizer_path):
    write_parquet(tmp_path / "x.parquet", {"tokens": [[1, 2]]})
    with pytest.raises(DataError, match=r"x\.parquet: missing column 'input_ids'"):
        take(build_dataset(DataConfig(source=str(tmp_path / "x.parquet"), format="tokens"), 10, seed=0), 1)
    with pytest.raises(DataError, match=r"x\.parquet: cannot tell the format"):
        build_dataset(DataConfig(source=str(tmp_path / "x.parquet")), 10, seed=0)
    write_jsonl(tmp_path / "t.jsonl", [{"text": "hello"}, {"body": "world"}])
    cfg = DataConfig(source=str(tmp_path / "t.jsonl"), tokenizer=tokenizer_path, bad_rows="stop")
    with pytest.raises(DataError, match=r"t\.jsonl row 2 \(line 2, counting from 1\): missing column 'text'"):
        take(build_dataset(cfg, 100, seed=0), 2)


def test_token_out_of_range_names_file_and_row(tmp_path):
    write_parquet(tmp_path / "x.parquet", {"input_ids": [[1, 2]] * 5 + [[3, 10]]}, row_group_size=2)
    cfg = DataConfig(source=str(tmp_path / "x.parquet"), shuffle=False, bad_rows="stop")
    with pytest.raises(DataError, match=r"x\.parquet row 6 \(counting from 1\): input_ids\[1\] = 10 is outside \[0, 10\)"):
        take(build_dataset(cfg, 10, seed=0), 1)


def test_tokenizer_larger_than_the_model_vocab_names_file_and_row(tmp_path, tokenizer_path):
    write_jsonl(tmp_path / "t.jsonl", [{"text": "hello"}, {"text": "ok"}])
    cfg = DataConfig(source=str(tmp_path / "t.jsonl"), tokenizer=tokenizer_path, shuffle=False, bad_rows="stop")
    with pytest.raises(DataError, match=r"t\.jsonl row 2 \(line 2, counting from 1\): tokens\[0\] = 23 is outside \[0, 20\)"):
        take(build_dataset(cfg, 20, seed=0), 1)


def test_empty_datasets(tmp_path):
    with pytest.raises(DataError, match="no data files match"):
        build_dataset(DataConfig(source=str(tmp_path / "*.parquet")), 10, seed=0)
    with pytest.raises(DataError, match="no such file"):
        build_dataset(DataConfig(source=str(tmp_path / "missing.parquet")), 10, seed=0)
    write_parquet(tmp_path / "e.parquet", {"input_ids": pa.array([], pa.list_(pa.int64()))})
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match=r"empty dataset: no rows in 2 file\(s\)"):
        build_dataset(DataConfig(source=str(tmp_path / "e.*")), 10, seed=0)
    write_parquet(tmp_path / "one.parquet", {"input_ids": [[5]]})  # one token: nothing to predict
    with pytest.raises(DataError, match="empty dataset: .* gave no training rows"):
        take(build_dataset(DataConfig(source=str(tmp_path / "one.parquet")), 10, seed=0), 1)


def test_too_long_document_without_truncation_names_file_and_row(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 2]}, {"input_ids": list(range(1, 10))}])
    cfg = DataConfig(source=str(tmp_path / "d.jsonl"), seq_len=8, truncate=False, shuffle=False)
    with pytest.raises(DataError, match=r"d\.jsonl row 2 \(line 2, counting from 1\): 9 tokens, longer than data\.seq_len=8"):
        take(build_dataset(cfg, 10, seed=0), 2)


def test_malformed_json_line_names_file_and_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"input_ids": [1, 2]}\n\n{"input_ids": oops}\n')
    cfg = DataConfig(source=str(tmp_path / "bad.jsonl"), format="tokens", shuffle=False, bad_rows="stop")
    with pytest.raises(DataError, match=r"bad\.jsonl row 2 \(line 3, counting from 1\): malformed JSON"):
        take(build_dataset(cfg, 10, seed=0), 1)


@pytest.mark.parametrize("line, where", [('{"input_ids": [1, 2], oops}', "Expecting property name enclosed in double "
                                          "quotes at column 23"),
                                         ('{"input_ids": [1, 2]', "Expecting ',' delimiter at the end of the line "
                                          "(column 21): the row is cut short")])
def test_malformed_json_names_the_column_of_the_line(tmp_path, line, where):
    (tmp_path / "bad.jsonl").write_text(f'{{"input_ids": [1, 2]}}\n{line}\n')
    cfg = DataConfig(source=str(tmp_path / "bad.jsonl"), format="tokens", shuffle=False, bad_rows="stop")
    with pytest.raises(DataError) as e:
        take(build_dataset(cfg, 10, seed=0), 2)
    assert f"(line 2, counting from 1): malformed JSON: {where}" in str(e.value), str(e.value)


def test_unknown_formats(tmp_path):
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"data\.csv: unknown format"):
        build_dataset(DataConfig(source=str(tmp_path / "data.csv")), 10, seed=0)
    with pytest.raises(DataError, match="unknown data.format 'csv'"):
        build_dataset(DataConfig(format="csv"), 10, seed=0)


def test_text_without_tokenizer_or_eos_is_refused(tmp_path, tokenizer_path):
    write_jsonl(tmp_path / "t.jsonl", [{"text": "hello"}])
    with pytest.raises(DataError, match="need data.tokenizer"):
        build_dataset(DataConfig(source=str(tmp_path / "t.jsonl")), 10, seed=0)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    tok.model = type(tok.model)({w: i for i, w in enumerate(w for w in WORDS if w != "</s>")}, unk_token="[UNK]")
    tok.save(str(tmp_path / "noeos.json"))
    with pytest.raises(DataError, match="no EOS token found"):
        build_dataset(DataConfig(source=str(tmp_path / "t.jsonl"), tokenizer=str(tmp_path / "noeos.json")), 30, seed=0)


def test_data_position_round_trip_and_validation():
    p = DataPosition(2, 17)
    assert DataPosition.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    with pytest.raises(DataError):
        DataPosition.from_dict({"epoch": -1, "index": 0})


def test_json_array_gzip_jsonl_and_int32_columns(tmp_path, tokenizer_path):
    import gzip

    (tmp_path / "alpaca.json").write_text(json.dumps([{"instruction": "hello", "input": "", "output": "yes"}]))
    with gzip.open(tmp_path / "chat.jsonl.gz", "wt") as f:
        f.write(json.dumps({"instruction": "hello", "output": "yes"}) + "\n")
    rows = []
    for name in ("alpaca.json", "chat.jsonl.gz"):
        cfg = DataConfig(source=str(tmp_path / name), tokenizer=tokenizer_path, seq_len=12, pack=False)
        rows.append(flat_rows(take(build_dataset(cfg, len(WORDS), seed=0), 1))[0])
    assert rows[0]["input_ids"].tolist() == rows[1]["input_ids"].tolist()
    assert trained_tokens(rows[0]) == ids("yes </s>")
    table = pa.table({"input_ids": pa.array([[1, 2, 3]], pa.list_(pa.int32())),
                      "loss_mask": pa.array([[False, True, True]], pa.list_(pa.bool_()))})
    pq.write_table(table, tmp_path / "i32.parquet")
    row = flat_rows(take(build_dataset(DataConfig(source=str(tmp_path / "i32.parquet"), seq_len=4), 10, seed=0), 1))[0]
    assert row["input_ids"].tolist() == [1, 2, 3, 0] and row["labels"].tolist() == [2, 3, -100, -100]
