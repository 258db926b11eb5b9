"""SFT rendered with the model's own chat template, against transformers' apply_chat_template.

Tiny tokenizers of the Qwen2.5 (ChatML, byte-level BPE), Llama-3 / 3.2 (header tokens, byte-level
BPE, a BOS the template writes) and Mistral (`[INST]`, metaspace BPE) kinds are trained here, saved
beside a tokenizer_config.json holding the family's template, and loaded by transformers as any
model's tokenizer. The ids must agree token for token; the loss mask must cover exactly the tokens
that transformers' `return_assistant_tokens_mask` marks for the same template with
`{% generation %}` blocks around the assistant's text and end-of-turn token.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
from transformers import AutoTokenizer  # noqa: E402

from megatrain_ray.config import DataConfig  # noqa: E402
from megatrain_ray.data import IGNORE_INDEX, DataError, build_dataset  # noqa: E402

QWEN = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" and not message.tool_calls %}
        {{- '<|im_start|>' + message.role + '\n' }}{% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}{{- '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {{- '\n<tool_call>\n' }}{{- tool_call | tojson }}{{- '\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set header = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' %}"
    "{% if loop.index0 == 0 %}{% set header = bos_token + header %}{% endif %}{{ header }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

LLAMA32 = r"""{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
    {%- if message['role'] == 'assistant' %}
        {%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}
    {%- else %}
        {{- message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

FAMILIES = {
    "qwen2.5": dict(template=QWEN, specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                    config={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None},
                    pre="bytelevel"),
    "llama-3": dict(template=LLAMA3, specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                               "<|end_header_id|>", "<|eot_id|>"],
                    config={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, pre="bytelevel",
                    bos="<|begin_of_text|>"),
    "llama-3.2": dict(template=LLAMA32, specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                                  "<|end_header_id|>", "<|eot_id|>"],
                      config={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, pre="bytelevel",
                      bos="<|begin_of_text|>"),
    "mistral": dict(template=MISTRAL, specials=["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
                    config={"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, pre="metaspace", bos="<s>"),
}

CONVERSATIONS = [
    [{"role": "system", "content": "You answer in short sentences."},
     {"role": "user", "content": "What colour is the sky?"},
     {"role": "assistant", "content": "Blue, on a clear day."},
     {"role": "user", "content": "And at night?"},
     {"role": "assistant", "content": "Dark, with stars.  "}],
    [{"role": "user", "content": "Name two animals."},
     {"role": "assistant", "content": "A cat and a dog."}],
    [{"role": "user", "content": "Count to three, then stop."},
     {"role": "assistant", "content": "One, two, three."},
     {"role": "user", "content": "Again, backwards?"},
     {"role": "assistant", "content": "Three, two, one."}],
]


def unmarked(template: str) -> str:
    """The family's template as the model ships it: without {% generation %} blocks."""
    for tag in ("{%- generation %}", "{%- endgeneration %}", "{% generation %}", "{% endgeneration %}"):
        template = template.replace(tag, "")
    return template


def train_tokenizer(family: dict, texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>" if family["pre"] == "metaspace" else None))
    if family["pre"] == "bytelevel":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
        alphabet = []
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=family["specials"], initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    if family.get("bos"):  # as the real ones: the post-processor adds BOS, which a chat must not get twice
        bos = family["bos"]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def make_model_dir(directory: Path, family: dict, template: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    texts = [m["content"] for conv in CONVERSATIONS for m in conv] * 20
    texts += ["You are Qwen, created by Alibaba Cloud. You are a helpful assistant.", "Cutting Knowledge Date",
              "Today Date: 01 Jan 2026 December", "user assistant system"] * 20
    train_tokenizer(family, texts).save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, **family["config"]}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return directory


def ours(model_dir: Path, rows: list[dict], tmp_path: Path, **data) -> list[tuple[list[int], list[int]]]:
    """(ids, trained token positions) per conversation, through build_dataset: unpacked, unshuffled rows."""
    from tokenizers import Tokenizer

    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    vocab = Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab_size()
    cfg = DataConfig(source=str(source), tokenizer=str(model_dir), seq_len=256, pack=False, shuffle=False, **data)
    dataset = build_dataset(cfg, vocab, seed=0)
    batches = dataset.batches(1, 1)
    out = []
    for _ in rows:
        mb = next(batches)[0][0]
        ids, labels = mb["input_ids"][0].tolist(), mb["labels"][0].tolist()
        trained = [t + 1 for t, label in enumerate(labels) if label != IGNORE_INDEX]
        assert all(labels[t - 1] == ids[t] for t in trained)  # labels are the next tokens
        out.append((ids, trained))
    return out


def reference(model_dir: Path, conversation: list[dict], marked_template: str) -> tuple[list[int], list[int]]:
    """transformers: the ids of the model's template, the assistant mask of its marked twin."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.apply_chat_template(conversation, tokenize=True, return_dict=True)["input_ids"]
    marked = tok.apply_chat_template(conversation, chat_template=marked_template, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
    assert marked["input_ids"] == ids  # the marks change nothing in the text
    return ids, [i for i, m in enumerate(marked["assistant_masks"]) if m]


@pytest.mark.parametrize("marked", [False, True], ids=["rendered-prefixes", "generation-blocks"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_messages_match_transformers_token_for_token(tmp_path, name, marked):
    family = FAMILIES[name]
    shipped = family["template"] if marked else unmarked(family["template"])
    model_dir = make_model_dir(tmp_path / "model", family, shipped)
    conversations = [c for c in CONVERSATIONS if name != "mistral" or c[0]["role"] != "system"]
    got = ours(model_dir, [{"messages": c} for c in conversations], tmp_path)
    for conversation, (ids, trained) in zip(conversations, got, strict=True):
        want_ids, want_trained = reference(model_dir, conversation, family["template"])
        assert ids[:len(want_ids)] == want_ids
        assert all(t == 0 for t in ids[len(want_ids):])  # then padding
        assert want_trained and want_trained[0] > 0
        assert trained == want_trained
        tok = AutoTokenizer.from_pretrained(model_dir)
        text = tok.decode([ids[t] for t in trained])
        for message in conversation:  # spot check: the answers, never the questions
            assert (message["content"].strip() in text) == (message["role"] == "assistant")
        if family.get("bos"):
            assert ids[:2].count(tok.convert_tokens_to_ids(family["bos"])) == 1


@pytest.mark.parametrize("name", ["qwen2.5", "llama-3"])
def test_alpaca_and_sharegpt_rows_render_as_messages(tmp_path, name):
    family = FAMILIES[name]
    model_dir = make_model_dir(tmp_path / "model", family, unmarked(family["template"]))
    rows = [{"instruction": "Name two animals.", "input": "", "output": "A cat and a dog."},
            {"instruction": "Count to three,", "input": "then stop.", "output": "One, two, three.",
             "system": "You answer in short sentences."}]
    conversations = [
        [{"role": "user", "content": "Name two animals."}, {"role": "assistant", "content": "A cat and a dog."}],
        [{"role": "system", "content": "You answer in short sentences."},
         {"role": "user", "content": "Count to three,\n\nthen stop."},
         {"role": "assistant", "content": "One, two, three."}],
    ]
    sharegpt = [{"conversations": [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]),
                                    "value": m["content"]} for m in c]} for c in conversations]
    for source_rows in (rows, sharegpt):
        (tmp_path / "rows.jsonl").unlink(missing_ok=True)
        for (ids, trained), conversation in zip(ours(model_dir, source_rows, tmp_path), conversations, strict=True):
            want_ids, want_trained = reference(model_dir, conversation, family["template"])
            assert ids[:len(want_ids)] == want_ids and trained == want_trained


def test_chat_template_jinja_file_wins_and_fallback_is_named(tmp_path):
    family = FAMILIES["qwen2.5"]
    model_dir = make_model_dir(tmp_path / "model", family, "{{ raise_exception('not this one') }}")
    (model_dir / "chat_template.jinja").write_text(unmarked(family["template"]))
    conversation = CONVERSATIONS[1]
    [(ids, trained)] = ours(model_dir, [{"messages": conversation}], tmp_path)
    want_ids, want_trained = reference(model_dir, conversation, family["template"])
    assert ids[:len(want_ids)] == want_ids and trained == want_trained

    (tmp_path / "rows.jsonl").unlink()
    [(ids, _)] = ours(model_dir, [{"messages": conversation}], tmp_path, chat_template="fallback", add_eos=True,
                      eos_token_id=3)
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok.decode(ids[:12]).startswith("### User:")


def test_template_errors_name_the_row(tmp_path):
    family = FAMILIES["mistral"]
    model_dir = make_model_dir(tmp_path / "model", family, unmarked(family["template"]))
    with pytest.raises(DataError, match=r"rows\.jsonl row 2 \(line 2, counting from 1\): the chat template of "
                                        r".*tokenizer_config\.json refused this conversation: Conversation roles must "
                                        r"alternate"):
        ours(model_dir, [{"messages": CONVERSATIONS[1]}, {"messages": CONVERSATIONS[0]}], tmp_path, bad_rows="stop")
    plain = make_model_dir(tmp_path / "plain", {**family, "config": family["config"]}, "")
    (plain / "tokenizer_config.json").write_text(json.dumps(family["config"]))
    (tmp_path / "rows.jsonl").unlink()
    with pytest.raises(DataError, match="data.chat_template=model but .* has no chat template"):
        ours(plain, [{"messages": CONVERSATIONS[1]}], tmp_path, chat_template="model")
    with pytest.raises(DataError, match="expected auto, model, fallback or a .jinja file"):
        ours(plain, [{"messages": CONVERSATIONS[1]}], tmp_path, chat_template="chatml")


def test_a_template_that_is_not_prefix_stable_is_refused(tmp_path):
    # The number of messages in the first line: a conversation's beginning renders differently.
    template = ("{{ messages | length }} turns\n{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    model_dir = make_model_dir(tmp_path / "model", FAMILIES["qwen2.5"], template)
    with pytest.raises(DataError, match=r"row 1 \(line 1, counting from 1\): the chat template .* renders the conversation up to message 1 "
                                        r"differently .* \{% generation %\} markers"):
        ours(model_dir, [{"messages": CONVERSATIONS[1]}], tmp_path)


def test_packing_keeps_conversations_apart(tmp_path):
    family = FAMILIES["qwen2.5"]
    model_dir = make_model_dir(tmp_path / "model", family, unmarked(family["template"]))
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS[1:]))
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab_size()
    cfg = DataConfig(source=str(source), tokenizer=str(model_dir), seq_len=512, pack=True, shuffle=False)
    mb = next(build_dataset(cfg, vocab, seed=0).batches(1, 1))[0][0]
    lengths = [len(reference(model_dir, c, family["template"])[0]) for c in CONVERSATIONS[1:]]
    positions = mb["position_ids"][0]
    assert positions[:lengths[0]].tolist() == list(range(lengths[0]))
    assert positions[lengths[0]:sum(lengths)].tolist() == list(range(lengths[1]))  # restarts: its own attention
    assert mb["labels"][0][lengths[0] - 1] == IGNORE_INDEX  # no target across the boundary
    assert np.all(mb["labels"][0][sum(lengths) - 1:] == IGNORE_INDEX)


def test_a_template_needs_no_eos_of_ours(tmp_path):
    family = {"specials": ["<|turn|>", "<|done|>"], "config": {}, "pre": "bytelevel"}
    template = ("{% for m in messages %}<|turn|>{{ m.role }}: {{ m.content }}<|done|>{% endfor %}"
                "{% if add_generation_prompt %}<|turn|>assistant: {% endif %}")
    model_dir = make_model_dir(tmp_path / "model", family, template)
    [(ids, trained)] = ours(model_dir, [{"messages": CONVERSATIONS[1]}], tmp_path)
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert ids[trained[-1]] == tok.convert_tokens_to_ids("<|done|>")
    (tmp_path / "rows.jsonl").unlink()
    with pytest.raises(DataError, match="no EOS token found"):
        ours(model_dir, [{"messages": CONVERSATIONS[1]}], tmp_path, chat_template="fallback")
