"""examples/finetune-sft.yaml end to end: a Hugging Face directory and SFT JSONL in, rendered with
the model's own chat template, through `megatrain-ray train` (store and executor actors on the
test session's Ray head), a validation loss that falls, and a model transformers loads out."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import ray
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from megatrain_ray import cli  # noqa: E402
from megatrain_ray.config import load_config  # noqa: E402
from megatrain_ray.data import build_dataset  # noqa: E402
from megatrain_ray.data.tokenization import TextEncoder  # noqa: E402
from megatrain_ray.files.hf import auto_tokenizer_mismatch  # noqa: E402
from megatrain_ray.files.hub import resolve_names  # noqa: E402
from helpers.examples import example_module  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "finetune-sft.yaml"
# The example's ChatML template with {% generation %} around each answer: transformers' own account
# of which tokens are the assistant's.
MARKED = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
          "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
          "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}")


def mean_loss(model, batches) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for mb in batches:
            logits = model(input_ids=torch.as_tensor(mb["input_ids"]),
                           position_ids=torch.as_tensor(mb["position_ids"])).logits
            labels = torch.as_tensor(mb["labels"]).reshape(-1)
            total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels, ignore_index=-100,
                                           reduction="sum"))
            count += int((labels != -100).sum())
    return total / count


SENTENCE = "reverse these words, please:\n\nred green blue <|im_end|> ### User: sort the list"


def reads_as_the_run(directory: Path, run_tokenizer: Path) -> None:
    """transformers' AutoTokenizer on `directory` gives the ids the run's tokenizer (data.tokenizer,
    read as the run reads it) gives for a full sentence, and decodes them back to it."""
    run = TextEncoder.load(str(run_tokenizer), load_config(CONFIG).data)
    want = run.encode([SENTENCE])[0].tolist()
    auto = AutoTokenizer.from_pretrained(directory)
    assert len(want) > 10 and auto(SENTENCE, add_special_tokens=False)["input_ids"] == want, type(auto).__name__
    assert auto.decode(want) == SENTENCE
    assert auto_tokenizer_mismatch(Path(directory), str(run_tokenizer)) is None


def test_the_examples_tokenizer_reads_with_auto_tokenizer_as_the_run_does(tmp_path):
    """The example's Qwen2 tokenizer: AutoTokenizer (which takes Qwen2Tokenizer for a qwen2 model,
    whatever tokenizer_config.json says) reads it as the run does."""
    example_module("make_tiny_hf_model").main([str(tmp_path)])
    reads_as_the_run(tmp_path / "model", tmp_path / "model")


def test_a_tokenizer_auto_tokenizer_reads_otherwise_is_told(tmp_path):
    """A word-level tokenizer beside a qwen2 config: AutoTokenizer rebuilds it as Qwen2's BPE, and
    the export's check says so and how to load it."""
    from helpers.files import word_tokenizer

    maker = example_module("make_tiny_hf_model")
    maker.write_model(tmp_path, seed=0, vocab_size=16)
    word_tokenizer(tmp_path, {w: i for i, w in enumerate(["[UNK]", "red", "green", "blue", "the", "fox"])})
    said = auto_tokenizer_mismatch(tmp_path, str(tmp_path))
    assert said is not None and "Qwen2Tokenizer" in said and "PreTrainedTokenizerFast.from_pretrained" in said, said


def test_finetune_example_trains_and_exports_a_transformers_model(tmp_path, ray_head, monkeypatch, capsys):
    """`megatrain-ray train` through the command's entry in this process (cli.main; a Python started
    for it would import torch and transformers again), joining the session's head as conftest's
    joining_env does; this process leaves Ray after it. The paths are relative to the directory it
    runs in, which is not the directory the head's actors work in: the run reads and writes there."""
    made = tmp_path / "tiny-hf"
    example_module("make_tiny_hf_model").main([str(made)])  # `python examples/make_tiny_hf_model.py DIR`
    model_dir, data, tokenizer = made / "model", made / "sft.jsonl", made / "model" / "tokenizer.json"
    out = tmp_path / "run"
    overrides = ["model.path=tiny-hf/model", "data.source=tiny-hf/sft.jsonl", "train.output_dir=run"]
    monkeypatch.setenv("RAY_ADDRESS", ray_head)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.chdir(tmp_path)
    try:
        code = cli.main(["train", str(CONFIG), *[arg for item in overrides for arg in ("--set", item)]])
    finally:
        ray.shutdown()
    run = capsys.readouterr()
    assert code == 0, run.out[-3000:] + run.err[-3000:]

    config = resolve_names(load_config(CONFIG, [f"model.path={model_dir}", f"data.source={data}"]))
    assert config.data.tokenizer == str(model_dir)  # the model's own tokenizer, by default
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, config.train.steps + 1))
    losses = [r["loss"] for r in records]
    assert losses[-1] < losses[0] - 0.5, losses
    validation = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    assert [s for s, _ in validation] == [4, 8, 12]
    assert validation[-1][1] < validation[0][1] - 0.3, validation  # it generalises to held-out rows
    assert f"validation loss {validation[-1][1]}" in run.out

    # The rows it trained on are the model's chat template, token for token as transformers renders it,
    # the loss on exactly the assistant's answer and its <|im_end|>.
    tok = AutoTokenizer.from_pretrained(model_dir)
    unpacked = dataclasses.replace(config.data, pack=False, shuffle=False)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    steps = build_dataset(unpacked, 256, seed=0).batches(1, 1)
    for row in rows[:4]:
        mb = next(steps)[0][0]
        user = f"{row['instruction']}\n\n{row['input']}" if row["input"] else row["instruction"]
        chat = [{"role": "user", "content": user}, {"role": "assistant", "content": row["output"]}]
        want = tok.apply_chat_template(chat, chat_template=MARKED, return_dict=True, return_assistant_tokens_mask=True)
        assert want["input_ids"] == tok.apply_chat_template(chat)["input_ids"]
        n = len(want["input_ids"])
        assert mb["input_ids"][0][:n].tolist() == want["input_ids"]
        trained = [t + 1 for t, label in enumerate(mb["labels"][0].tolist()) if label != -100]
        assert trained == [i for i, m in enumerate(want["assistant_masks"]) if m]
        assert mb["input_ids"][0][trained[-1]] == tok.convert_tokens_to_ids("<|im_end|>")

    exports = sorted((out / "checkpoints").glob("step-*/hf"))
    assert [e.parent.name for e in exports] == [f"step-{config.train.steps:08d}"]
    assert "warning" not in run.out
    reads_as_the_run(exports[0], model_dir)  # the export's tokenizer loads with the Auto classes as the run read it
    assert cli.main(["export", str(exports[0].parent), str(tmp_path / "exported")]) == 0
    assert "with the tokenizer's tokenizer.json, tokenizer_config.json" in capsys.readouterr().out
    reads_as_the_run(tmp_path / "exported", model_dir)  # and so does `megatrain-ray export`'s
    tuned = AutoModelForCausalLM.from_pretrained(exports[0], dtype=torch.float32).eval()
    initial = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tuned_sd, initial_sd = tuned.state_dict(), initial.state_dict()
    assert set(tuned_sd) == set(initial_sd)
    for name, before in initial_sd.items():
        assert not torch.equal(tuned_sd[name], before), f"{name} did not change"
    # The run started from the Hugging Face weights, not from a random init: embedding rows of ids
    # the tokenizer never produces get no gradient and (weight_decay 0) stay exactly as loaded.
    assert config.optim.weight_decay == 0.0
    used = json.loads(tokenizer.read_text())["model"]["vocab"]
    unused = slice(max(used.values()) + 1, None)
    embed = "model.embed_tokens.weight"
    assert torch.equal(tuned_sd[embed][unused], initial_sd[embed][unused])

    # transformers itself sees the fine-tuned model predict the SFT responses better.
    dataset = build_dataset(config.data, tuned.config.vocab_size, seed=1)
    steps = dataset.batches(config.train.micro_batch_size, 1)
    batches = [next(steps)[0][0] for _ in range(3)]
    assert mean_loss(tuned, batches) < mean_loss(initial, batches) - 0.5


def test_the_example_reads_sharegpt_rows_too(tmp_path):
    """The example pins no format: ShareGPT rows through it are told by their columns."""
    from helpers.files import word_tokenizer
    from megatrain_ray.data.summary import summarize

    words = ["[UNK]", "</s>", "###", "User", "Assistant", ":", "hello", "yes"]
    word_tokenizer(tmp_path, {w: i for i, w in enumerate(words)})
    chat = {"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "yes"}]}
    (tmp_path / "chat.jsonl").write_text((json.dumps(chat) + "\n") * 10)
    config = load_config(CONFIG, [f"data.source={tmp_path / 'chat.jsonl'}", f"data.tokenizer={tmp_path}",
                                  "data.chat_template=fallback", "eval.holdout_fraction=0"])
    dataset = build_dataset(config.data, len(words), seed=0)
    assert dataset.format == "sharegpt"
    counted = summarize(dataset)
    assert counted.rows_trainable == 10 and not counted.rows_bad
