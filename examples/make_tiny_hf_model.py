"""Make the inputs of examples/finetune-sft.yaml: a tiny random Hugging Face model, its tokenizer
and an SFT data set, so that the fine-tuning path runs on a laptop with no download.

    python examples/make_tiny_hf_model.py runs/tiny-hf

writes
    runs/tiny-hf/model/     config.json + model.safetensors (a random Qwen2ForCausalLM, hidden 64,
                            2 layers, vocab 256), tokenizer.json and tokenizer_config.json with
                            a ChatML chat template (<|im_start|>role ... <|im_end|>), as Qwen's
    runs/tiny-hf/sft.jsonl  alpaca rows {"instruction", "input", "output"}
    runs/tiny-hf/prompts.jsonl  prompts for reinforcement learning (examples/grpo.yaml): chat
                            {"messages"} asking for the first or last of a list of three words, and
                            the "answer" the rewards compare with

The tokenizer is a Qwen2 one, as small as the data allows: byte-level BPE (the `tokenizers`
library) with Qwen2's pre-tokenizer, trained on the few words the data uses so that each is one
token, with "<|im_end|>" as EOS (the end of an assistant turn); its vocabulary is smaller than the
model's. tokenizer_config.json names it `Qwen2Tokenizer`, the class transformers' AutoTokenizer
picks for a qwen2 model whatever the file says, and that class rebuilds exactly this tokenizer from
tokenizer.json: AutoTokenizer reads the directory (and its export) as the run reads tokenizer.json.
The tasks (reverse, repeat, sort, copy a list of colour/animal/number words) are ones a tiny model
starts to learn within a few dozen steps. Needs `transformers` (pip install -e ".[test]").
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SPECIAL = ["<|endoftext|>", "<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]
TEMPLATE_WORDS = ["user", "assistant", "system", "###", "User", "Assistant", "System", ":", ","]
CHAT_TEMPLATE = (  # ChatML, the format of Qwen's instruct models
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'"
    " + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TASKS = ["reverse", "repeat", "sort", "copy", "first", "last"]
WORDS = [
    "red", "green", "blue", "yellow", "black", "white", "orange", "purple",
    "cat", "dog", "bird", "fish", "horse", "mouse", "lion", "bear",
    "one", "two", "three", "four", "five", "six", "seven", "eight",
]
FILLER = ["please", "the", "words", "list", "these", "this", "of", "and", "answer", "with"]
MODEL = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rope_theta=1e6, tie_word_embeddings=False,
)


QWEN2_SPLIT = (  # Qwen2's pre-tokenizer: what transformers' Qwen2Tokenizer splits text with before BPE
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def training_text(words: list[str]) -> list[str]:
    """Each word at a line's start and after a space, and the separators the templates use."""
    return [piece for word in words for piece in (word, " " + word, "\n" + word)] + ["\n", "\n\n", ": ", ", "]


def build_tokenizer(words: list[str], special: list[str], vocab_size: int):
    """A byte-level BPE tokenizer as Qwen2's (normalizer, pre-tokenizer, decoder), trained on
    `words` (training_text): the special tokens take the first ids, each word one token."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    tokenizer = Tokenizer(BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                              fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False)
    tokenizer.train_from_iterator(training_text(words), trainer)
    return tokenizer


def write_tokenizer(directory: Path) -> dict[str, int]:
    """tokenizer.json and tokenizer_config.json (the chat template, the special tokens); returns the vocabulary."""
    tokenizer = build_tokenizer(TEMPLATE_WORDS + TASKS + WORDS + FILLER, SPECIAL, MODEL["vocab_size"])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "unk_token": "<unk>", "pad_token": "<pad>",
        "bos_token": None, "add_prefix_space": False, "model_max_length": MODEL["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }, indent=2) + "\n")
    return tokenizer.get_vocab()


def answer(task: str, words: list[str]) -> list[str]:
    return {
        "reverse": words[::-1],
        "repeat": words + words,
        "sort": sorted(words),
        "copy": words,
        "first": words[:1],
        "last": words[-1:],
    }[task]


def sft_rows(count: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        task = TASKS[i % len(TASKS)]
        words = rng.sample(WORDS, rng.randint(2, 5))
        instruction = f"{task} {rng.choice(['these words', 'the list', 'this list of words', 'the words'])}"
        rows.append({"instruction": instruction, "input": " ".join(words), "output": " ".join(answer(task, words))})
    return rows


def prompt_rows(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed + 1)
    rows = []
    for i in range(count):
        task, words = ("first", "last")[i % 2], rng.sample(WORDS, 3)  # one length: the answer's place is fixed
        rows.append({"messages": [{"role": "user", "content": f"{task} {' '.join(words)}"}],
                     "answer": answer(task, words)[0]})
    return rows


def write_model(directory: Path, seed: int, vocab_size: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    config = Qwen2Config(**MODEL, eos_token_id=SPECIAL.index("<|im_end|>"), pad_token_id=SPECIAL.index("<pad>"),
                         bos_token_id=None)
    assert vocab_size <= config.vocab_size, "the tokenizer's ids must fit the model's vocabulary"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory, safe_serialization=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default="runs/tiny-hf", help="directory to write (default runs/tiny-hf)")
    parser.add_argument("--rows", type=int, default=64, help="SFT rows (default 64)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    out = Path(args.out)
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(model_dir)
    write_model(model_dir, args.seed, len(vocab))
    with open(out / "sft.jsonl", "w") as f:
        for row in sft_rows(args.rows, args.seed):
            f.write(json.dumps(row) + "\n")
    with open(out / "prompts.jsonl", "w") as f:
        for row in prompt_rows(args.rows, args.seed):
            f.write(json.dumps(row) + "\n")
    print(f"model + tokenizer: {model_dir}\nSFT data ({args.rows} rows): {out / 'sft.jsonl'}\n"
          f"prompts ({args.rows} rows): {out / 'prompts.jsonl'}")


if __name__ == "__main__":
    main()
