"""The data summary counts exactly what was planted: rows read, skipped by reason, truncated,
tokens and loss-carrying tokens (counted here from the fallback template's text, word by word);
a source without a trainable row is refused with its reasons, before Ray, exit 2."""

import dataclasses
import json
from pathlib import Path

import pytest

from megatrain_ray.config import DataConfig, EvalConfig
from megatrain_ray.data import DataError, build_dataset
from megatrain_ray.data.summary import summarize, summarize_data
from helpers.files import word_tokenizer, write_jsonl

SEQ_LEN = 16
WORDS = ["[UNK]", "</s>", "###", "User", "Assistant", ":", "what", "is", "two", "plus", "four", "hello", "yes", "ok"]


@pytest.fixture
def tokenizer_path(tmp_path: Path) -> str:
    """One token a word (and a token for ':'), so that counts can be made here by splitting."""
    return word_tokenizer(tmp_path, {w: i for i, w in enumerate(WORDS)})


def ids(text: str) -> list[str]:
    return text.replace(":", " : ").split()


def chat(user: str, answer: str | None) -> dict:
    turns = [{"from": "human", "value": user}]
    return {"conversations": turns + ([] if answer is None else [{"from": "gpt", "value": answer}])}


def planted_rows() -> tuple[list[dict], dict]:
    good = [chat("what is two plus two", "four")] * 5
    long_prompt = chat(" ".join(["hello"] * 20), "yes")  # its answer lies past data.seq_len: nothing left
    long_answer = chat("hello", " ".join(["ok"] * 20))  # cut, some answer kept
    rows = (good[:2] + [{"conversations": []}] * 2 + [chat("hello", None)] * 3 + good[2:]
            + [chat("hello", "")] * 3 + [chat("hello", "  ")] + [long_prompt, long_answer])
    # Fallback template: "### User: {user}" / "### Assistant: {answer}</s>", one token a word here.
    good_tokens = len(ids("### User: what is two plus two")) + len(ids("### Assistant:")) + len(ids("four")) + 1
    expected = {
        "rows_read": 16, "rows_split_off": 0, "rows_truncated": 2, "rows_trainable": 6,
        "rows_skipped": {"empty conversation": 2, "no assistant turn": 3, "empty answer": 4,
                         "answer cut off by data.seq_len": 1},
        "tokens": 5 * good_tokens + SEQ_LEN,
        # a good row: "four" and EOS; the cut row: its positions from the last prompt token on predict
        # answer words (the last position the word just past the window)
        "loss_tokens": 5 * 2 + (SEQ_LEN - len(ids("### User: hello")) - len(ids("### Assistant:")) + 1),
    }
    return rows, expected


def sft_config(source: Path, tokenizer: str) -> DataConfig:
    return DataConfig(source=str(source), format="sharegpt", tokenizer=tokenizer, seq_len=SEQ_LEN, truncate=True,
                      chat_template="fallback")


def test_planted_bad_rows_are_counted_by_reason(tmp_path, tokenizer_path):
    rows, expected = planted_rows()
    source = write_jsonl(tmp_path / "chat.jsonl", rows)
    summary = summarize(build_dataset(sft_config(source, tokenizer_path), 64, 0)).to_dict()
    assert {k: summary[k] for k in expected} == expected
    assert summary["files"] == 1 and summary["complete"] and summary["rows_bad"] == {}


def test_a_summary_of_a_first_part_says_so(tmp_path, tokenizer_path):
    rows, _ = planted_rows()
    source = write_jsonl(tmp_path / "chat.jsonl", rows)
    config = dataclasses.replace(sft_config(source, tokenizer_path), read_batch_rows=1)
    summary = summarize(build_dataset(config, 64, 0), max_rows=2, max_bytes=100)  # larger: counted in part
    assert not summary.complete and summary.rows_read == 2 and "(the first 2 rows of 0.0 GB;" in summary.describe()


def test_held_out_rows_are_counted_apart(tmp_path, tokenizer_path, capsys):
    rows, expected = planted_rows()
    source = write_jsonl(tmp_path / "chat.jsonl", rows * 4)
    counted = summarize_data(sft_config(source, tokenizer_path), EvalConfig(holdout_fraction=0.3), 64, 0)
    train, held = counted["train"], counted["validation"]
    assert train["rows_read"] == held["rows_read"] == 4 * expected["rows_read"]
    assert train["rows_split_off"] + held["rows_split_off"] == 4 * expected["rows_read"]  # each row on one side
    assert sum(train["rows_skipped"].values()) + sum(held["rows_skipped"].values()) == 4 * 10
    out = capsys.readouterr().out
    assert "validation data:" in out and "left to training" in out and "held out for validation" in out


def test_a_source_without_trainable_rows_is_refused_with_its_reasons(tmp_path, tokenizer_path):
    source = write_jsonl(tmp_path / "bad.jsonl", [{"conversations": []}, chat("hello", None), chat("hello", "")])
    with pytest.raises(DataError, match="no trainable rows") as e:
        summarize(build_dataset(sft_config(source, tokenizer_path), 64, 0))
    assert "1 empty conversation" in str(e.value) and "1 no assistant turn" in str(e.value)
    assert "1 empty answer" in str(e.value)


def test_the_cli_refuses_it_before_ray(tmp_path, tokenizer_path, capsys, monkeypatch):
    """The command's entry in this process (cli.main): a Python started for it would import torch again."""
    import ray

    from megatrain_ray import cli

    monkeypatch.setenv("RAY_ADDRESS", "local")  # no cluster to join: a Ray would start here
    source = write_jsonl(tmp_path / "bad.jsonl", [{"conversations": []}] * 3)
    config = {"model": {"preset": "tiny-llama"}, "train": {"output_dir": str(tmp_path / "out")},
              "data": {"source": str(source), "tokenizer": tokenizer_path, "seq_len": SEQ_LEN,
                       "chat_template": "fallback"}}
    (tmp_path / "c.yaml").write_text(json.dumps(config))
    code = cli.main(["train", str(tmp_path / "c.yaml")])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert "no trainable rows in training data" in err and "3 empty conversation" in err
    assert "Ray" not in out + err and "Traceback" not in err and not ray.is_initialized()
