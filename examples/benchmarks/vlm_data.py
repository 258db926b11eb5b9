"""A Qwen2.5-VL-7B-shaped model directory without weights (random init) and image-text SFT rows for
it, made offline: the published 7B config's sizes, a word-level tokenizer with Qwen's special tokens
at their ids, the model's own image processor and a ChatML template with its vision tokens, random
images and ShareGPT rows (`messages` with `<image>`, `images`) that fill most of a 4,096-token row.

    python examples/benchmarks/vlm_data.py OUT_DIR [--rows 64] [--image-side 896] [--images-per-row 2] [--small]

OUT_DIR/model/config.json (model.preset) and its processor files (data.tokenizer); OUT_DIR/rows.jsonl.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

# Qwen2.5-VL-7B-Instruct's config.json sizes (the config class's defaults are the 72B's)
TEXT = {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 128000,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        "tie_word_embeddings": False}
VISION = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 3584,
          "fullatt_block_indexes": [7, 15, 23, 31], "window_size": 112, "patch_size": 14, "spatial_merge_size": 2,
          "temporal_patch_size": 2}
SPECIAL = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|vision_start|>": 151652,
           "<|vision_end|>": 151653, "<|image_pad|>": 151655, "<|video_pad|>": 151656}
WORDS = [f"w{i}" for i in range(2000)] + ["user", "assistant", "system"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}"
          "{% else %}{% for c in m.content %}{% if c.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
          "{% else %}{{ c.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# --small: the same structure at a size the CPU trains in seconds (a smoke test of the script)
SMALL_TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                                            "mrope_section": [2, 3, 3]}}
SMALL_VISION = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                "fullatt_block_indexes": [1]}


def model_dir(out: Path, small: bool = False) -> Path:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import AutoConfig, PreTrainedTokenizerFast
    from transformers.models.auto.image_processing_auto import (IMAGE_PROCESSOR_MAPPING_NAMES,
                                                                get_image_processor_class_from_name)

    out.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.for_model("qwen2_5_vl").to_dict()
    config["text_config"].update({**TEXT, **(SMALL_TEXT if small else {})})
    config["text_config"]["layer_types"] = ["full_attention"] * config["text_config"]["num_hidden_layers"]
    config["vision_config"].update({**VISION, **(SMALL_VISION if small else {})})
    config.update(image_token_id=SPECIAL["<|image_pad|>"], video_token_id=SPECIAL["<|video_pad|>"],
                  vision_start_token_id=SPECIAL["<|vision_start|>"], vision_end_token_id=SPECIAL["<|vision_end|>"])
    (out / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "transformers_version"}))
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}, **SPECIAL}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": list(SPECIAL)})
    fast.save_pretrained(out)
    image_processor = get_image_processor_class_from_name(IMAGE_PROCESSOR_MAPPING_NAMES["qwen2_5_vl"]["pil"])()
    image_processor.save_pretrained(out)
    (out / "chat_template.jinja").write_text(CHATML)
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor"}))
    return out


def rows(out: Path, count: int, side: int, per_row: int, seq_len: int = 4096) -> Path:
    from PIL import Image

    rng = np.random.default_rng(0)
    images = []
    for i in range(4):
        path = out / "images" / f"image{i}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(path)
        images.append(str(path))
    image_tokens = per_row * (side // 28) ** 2
    words = max(16, seq_len - image_tokens - 64)  # the rest of the row: text, a token a word

    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS[:2000], n))

    lines = []
    for i in range(count):
        question, answer = text(words // 3), text(words - words // 3)
        lines.append({"messages": [{"role": "user", "content": "<image>" * per_row + question},
                                   {"role": "assistant", "content": answer}],
                      "images": [images[(i + k) % len(images)] for k in range(per_row)]})
    path = out / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--image-side", type=int, default=896)
    parser.add_argument("--images-per-row", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--small", action="store_true", help="a tiny model of the same structure (CPU smoke test)")
    args = parser.parse_args()
    print(model_dir(args.out / "model", args.small),
          rows(args.out, args.rows, args.image_side, args.images_per_row, args.seq_len))


if __name__ == "__main__":
    main()
