"""Hub names for model.path and data.tokenizer: resolved from a local Hugging Face cache, offline;
a name that is not cached fails in one paragraph naming the command that downloads it. The cache is
built here, in the layout huggingface_hub writes (refs/main -> snapshots/<commit>/files); no network."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from megatrain_ray.api import to_config  # noqa: E402
from megatrain_ray.cli import main  # noqa: E402
from megatrain_ray.data import build_dataset  # noqa: E402
from megatrain_ray.files.hub import HubError, looks_like_hub_name, resolve_names  # noqa: E402
from megatrain_ray.models.registry import model_arch  # noqa: E402
from helpers.examples import example_module  # noqa: E402

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    """HF_HOME with org/tiny-model cached (a Qwen2 model, its tokenizer and chat template), offline."""
    home = tmp_path / "hf-home"
    repo = home / "hub" / "models--org--tiny-model"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    maker = example_module("make_tiny_hf_model")
    vocab = maker.write_tokenizer(snapshot)
    maker.write_model(snapshot, seed=0, vocab_size=len(vocab))
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return home


def test_names_and_paths_are_told_apart(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert looks_like_hub_name("Qwen/Qwen2.5-7B-Instruct") and looks_like_hub_name("runs/no-such-model")
    (tmp_path / "models" / "qwen").mkdir(parents=True)
    for local in ("models/qwen", "/models/qwen", "./qwen", "~/qwen", "runs/tiny-hf/model", "tok/tokenizer.json",
                  "gpt2"):  # not the Hub's owner/name shape: a path, here or missing
        assert not looks_like_hub_name(local), local


@pytest.mark.parametrize("path", ["runs/no-such/model", "no-such-model"])
def test_a_missing_relative_path_is_a_missing_file_not_a_hub_name(hf_home, capsys, path):
    config = hf_home.parent / "c.yaml"
    config.write_text(f"model: {{path: {path}}}\n")
    assert main(["plan", str(config)]) == 2  # before any cluster is joined
    out, err = capsys.readouterr()
    assert err.startswith(f"megatrain-ray: configuration error: model.path {path!r}: no such file or directory "
                          f"(relative to {hf_home.parent})"), err
    assert "Hub" not in out and "hf download" not in err and err.count("\n") == 1, out + err


def test_a_missing_directory_of_the_hubs_shape_is_said_to_be_both(hf_home):
    with pytest.raises(HubError) as error:
        resolve_names(to_config({"model": {"path": "runs/no-such-model"}}))
    message = str(error.value)
    assert message.startswith(f"model.path 'runs/no-such-model' is not a local path (there is no directory "
                              f"runs/no-such-model here ({hf_home.parent})), and as a Hugging Face Hub name it is "
                              f"not in {hf_home / 'hub'}"), message
    assert "HF_HUB_OFFLINE is set: check the path, or download it" in message and "`hf download runs/no-such-model`" in message


def test_a_cached_model_resolves_offline_and_brings_its_tokenizer(hf_home, tmp_path):
    rows = tmp_path / "sft.jsonl"
    rows.write_text(json.dumps({"instruction": "reverse the list", "input": "red cat", "output": "cat red"}) + "\n")
    config = resolve_names(to_config({"model": {"path": "org/tiny-model"},
                                      "data": {"source": str(rows), "seq_len": 32}}))
    snapshot = hf_home / "hub" / "models--org--tiny-model" / "snapshots" / COMMIT
    assert Path(config.model.path) == snapshot
    assert config.data.tokenizer == config.model.path  # the model's own tokenizer, by default
    arch = model_arch(config.model)
    assert (arch.hidden_size, arch.num_layers) == (64, 2)
    dataset = build_dataset(config.data, arch.vocab_size, seed=0)
    assert dataset.encoder.path == str(snapshot / "tokenizer.json")

    tokenizer_only = resolve_names(to_config({"model": {"preset": "tiny-llama"},
                                              "data": {"source": str(rows), "tokenizer": "org/tiny-model"}}))
    assert Path(tokenizer_only.data.tokenizer) == snapshot


def test_a_missing_name_offline_fails_in_one_paragraph_with_the_command(hf_home, capsys):
    with pytest.raises(HubError) as error:
        resolve_names(to_config({"model": {"path": "org/not-downloaded"}}))
    message = str(error.value)
    assert "\n" not in message
    assert "model.path 'org/not-downloaded'" in message and "HF_HUB_OFFLINE" in message
    assert "`hf download org/not-downloaded`" in message and str(hf_home / "hub") in message

    config = hf_home.parent / "c.yaml"
    config.write_text("model: {path: org/not-downloaded}\n")
    assert main(["plan", str(config)]) == 2  # before any cluster is joined
    err = capsys.readouterr().err
    assert err.startswith("megatrain-ray: configuration error: model.path 'org/not-downloaded' is not a local path")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert main(["train", str(config), "--set", "model.path=org/tiny-model",
                 "--set", "data.tokenizer=org/no-tokenizer"]) == 2
    assert "data.tokenizer 'org/no-tokenizer'" in capsys.readouterr().err
    assert "ray" not in sys.modules or not __import__("ray").is_initialized()
