"""Make the inputs of examples/finetune-image-text.yaml: a tiny random LLaVA model with its
processor, and image-text rows, so that the image-text path runs on a laptop with no download and
no torchvision.

    python examples/make_tiny_image_text_model.py runs/tiny-vl

writes
    runs/tiny-vl/model/     config.json + model.safetensors (a random LlavaForConditionalGeneration:
                            a CLIP vision tower of 28-pixel images in 2 x 2 patches, a Llama decoder
                            of hidden 64, 2 layers, vocab 256), and its processor's files as
                            transformers writes them: preprocessor_config.json (CLIP's resizing, on
                            PIL), processor_config.json, the tokenizer and a ChatML chat template
    runs/tiny-vl/images/    one PNG a colour (red.png, green.png, ...), 28 x 28 pixels
    runs/tiny-vl/rows.jsonl ShareGPT rows as LlamaFactory writes them: `messages` whose user turn
                            holds an `<image>` placeholder, and `images`, paths relative to the file;
                            the assistant answers the image's colour. The last row's image does not
                            exist: the run skips it as a bad row and says so.

The tokenizer is examples/make_tiny_hf_model.py's kind (byte-level BPE over the few words used);
transformers' AutoProcessor loads it, with the image processor, as the run does (LLaVA's processor
has no video processor, so it needs no torchvision). Needs `transformers` and `pillow`.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tiny_hf_model import build_tokenizer  # noqa: E402  (the same kind of tokenizer)

SPECIAL = ["<|endoftext|>", "<unk>", "<pad>", "<|im_start|>", "<|im_end|>", "<image>"]
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (30, 60, 220), "yellow": (230, 220, 40),
           "black": (10, 10, 10), "white": (245, 245, 245)}
QUESTIONS = ["what colour is this", "which colour is it", "name the colour", "what colour do you see"]
WORDS = ["user", "assistant", "system", *COLOURS, *{w for q in QUESTIONS for w in q.split()}, "it", "is", "a", "picture"]
CHAT_TEMPLATE = (  # ChatML, an image item of a message's content written as <image>
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<image>' }}{% else %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
IMAGE, PATCH = 28, 14  # pixels a side: 2 x 2 patches, 4 image tokens
TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
VISION = dict(image_size=IMAGE, patch_size=PATCH, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=2, projection_dim=32)


def write_processor(directory: Path):
    """The tokenizer, CLIP's image processor (PIL) and LLaVA's processor over them, saved as
    transformers saves a processor; returns the processor."""
    from transformers import CLIPImageProcessorPil, LlavaProcessor, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(WORDS, SPECIAL, TEXT["vocab_size"]), eos_token="<|im_end|>",
        pad_token="<pad>", unk_token="<unk>", model_max_length=TEXT["max_position_embeddings"])
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": IMAGE}, crop_size={"height": IMAGE, "width": IMAGE})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(directory)
    return processor


def write_model(directory: Path, tokenizer, seed: int) -> None:
    import torch
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(seed)
    config = LlavaConfig(
        text_config={"model_type": "llama", **TEXT, "eos_token_id": tokenizer.eos_token_id,
                     "pad_token_id": tokenizer.pad_token_id, "bos_token_id": None},
        vision_config={"model_type": "clip_vision_model", **VISION},
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_select_strategy="default",
        projector_hidden_act="gelu")
    assert len(tokenizer) <= TEXT["vocab_size"], "the tokenizer's ids must fit the model's vocabulary"
    LlavaForConditionalGeneration(config).save_pretrained(directory)


def write_images(directory: Path) -> None:
    from PIL import Image

    directory.mkdir(parents=True, exist_ok=True)
    for name, rgb in COLOURS.items():
        Image.new("RGB", (IMAGE, IMAGE), rgb).save(directory / f"{name}.png")


def rows(count: int, seed: int) -> list[dict]:
    """`count` rows asking for an image's colour; the last names an image that does not exist."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        colour = list(COLOURS)[i % len(COLOURS)]
        image = f"images/{colour}.png" if i < count - 1 else "images/missing.png"
        out.append({"messages": [{"role": "user", "content": f"<image>{rng.choice(QUESTIONS)}"},
                                 {"role": "assistant", "content": colour}], "images": [image]})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default="runs/tiny-vl", help="directory to write (default runs/tiny-vl)")
    parser.add_argument("--rows", type=int, default=48, help="image-text rows (default 48, the last one bad)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    out = Path(args.out)
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    processor = write_processor(model_dir)
    write_model(model_dir, processor.tokenizer, args.seed)
    write_images(out / "images")
    with open(out / "rows.jsonl", "w") as f:
        for row in rows(args.rows, args.seed):
            f.write(json.dumps(row) + "\n")
    print(f"model + processor: {model_dir}\nimages: {out / 'images'}\n"
          f"image-text rows ({args.rows}, the last one's image missing): {out / 'rows.jsonl'}")


if __name__ == "__main__":
    main()
