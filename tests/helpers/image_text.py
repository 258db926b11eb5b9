"""Tiny image-text models as a user's directory holds them: transformers' config class with its
default values, only the sizes cut (widths, layers, image size, image tokens), a word-level
tokenizer with the model's image tokens, the model's own processor saved beside them (its image
processor's PIL path: no torchvision here), and image-text SFT rows with tiny random images."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch


WORDS = "user assistant a the cat dog red blue sky is on what see picture describe this it yes no".split()
TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 96}
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "depth": 1, "num_attention_heads": 2,
          "num_heads": 2, "head_dim": 16}
GLM4V_TOKENS = ["<|begin_of_image|>", "<|image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|video|>", "<|end_of_video|>"]
# a config's token ids -> the tokens they are (of the type's tokens)
TOKEN_KEYS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>", "vision_start_token_id": "<|vision_start|>",
              "vision_end_token_id": "<|vision_end|>", "image_token_index": "<image>", "boi_token_index": "<start_of_image>",
              "eoi_token_index": "<end_of_image>"}
TYPE_TOKEN_KEYS = {"gemma3": {"image_token_index": "<image_soft_token>"}, "mistral3": {"image_token_index": "[IMG]"},
                   "idefics3": {"image_token_id": "<image>"},
                   "llava_onevision": {"video_token_index": "<video>"}, "internvl": {"image_token_id": "<IMG_CONTEXT>"},
                   "aya_vision": {"image_token_index": "<|IMG_PATCH|>"},
                   "cohere2_vision": {"image_token_id": "<|IMG_PATCH|>"}, "lfm2_vl": {"image_token_id": "<image>"},
                   "gemma4": {"boi_token_id": "<start_of_image>", "eoi_token_id": "<end_of_image>",
                              "image_token_id": "<image_soft_token>", "video_token_id": "<|video|>",
                              "audio_token_id": "<audio_soft_token>", "boa_token_id": "<start_of_audio>",
                              "eoa_token_index": "<end_of_audio>"},
                   "paddleocr_vl": {"image_token_id": "<|IMAGE_PLACEHOLDER|>", "vision_start_token_id": "<|IMAGE_START|>",
                                    "vision_end_token_id": "<|IMAGE_END|>", "video_token_id": "<|VIDEO_PLACEHOLDER|>"},
                   "hunyuan_vl": {"image_token_id": "<hy_image>"}, "minicpmv4_6": {"image_token_id": "<|image_pad|>"},
                   "minicpm_ocr": {"image_token_id": "<|image_pad|>"},
                   "got_ocr2": {"image_token_index": "<imgpad>"}, "aria": {"image_token_index": "<|img|>"},
                   "minicpmv4_7": {"image_token_id": "<|image_pad|>", "image_start_id": "<image>",
                                   "image_end_id": "</image>", "slice_start_id": "<slice>", "slice_end_id": "</slice>"},
                   "glm4v": dict(zip(["image_start_token_id", "image_token_id", "image_end_token_id", "video_start_token_id",
                                      "video_token_id", "video_end_token_id"], GLM4V_TOKENS, strict=True))}
IMAGE = 28  # pixels a side: 2 x 2 patches of 14
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}"
          "{% else %}{% for c in m.content %}{% if c.type == 'image' %}IMAGE{% else %}{{ c.text }}{% endif %}"
          "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Qwen3.5's tiny decoder (qwen3_5 below; MiniCPM-V's too)
QWEN3_5_TEXT = {"layer_types": ["linear_attention", "full_attention"], "head_dim": 32,
                "rope_parameters": {"mrope_section": [2, 1, 1]},
                "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
                "linear_num_value_heads": 4}
# model_type -> (its tokens beside ChatML's, the placeholder its template writes for an image,
#                its config's sizes beside TEXT and VISION, its image processor's sizes)
TYPES = {
    "qwen2_5_vl": (["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"],
                   "<|vision_start|><|image_pad|><|vision_end|>",
                   {"text_config": {"rope_parameters": {"mrope_section": [2, 3, 3]}},
                    "vision_config": {"out_hidden_size": 64, "fullatt_block_indexes": [0], "window_size": 56}},
                   {"min_pixels": 28 * 28, "max_pixels": 56 * 56}),
    "llava": (["<image>"], "<image>",
              {"vision_config": {"image_size": IMAGE, "patch_size": 14, "num_hidden_layers": 2, "projection_dim": 32}},
              {"size": {"shortest_edge": IMAGE}, "crop_size": {"height": IMAGE, "width": IMAGE}}),
    "gemma3": (["<start_of_image>", "<end_of_image>", "<image_soft_token>"], "<start_of_image>",
               {"text_config": {"num_hidden_layers": 6, "sliding_window": 8, "query_pre_attn_scalar": 16},
                "vision_config": {"image_size": IMAGE, "patch_size": 14}, "mm_tokens_per_image": 4},
               {"size": {"height": IMAGE, "width": IMAGE}}),
    "llava_next": (["<image>"], "<image>",
                   {"vision_config": {"image_size": IMAGE, "patch_size": 14, "num_hidden_layers": 2,
                                      "projection_dim": 32},
                    "image_grid_pinpoints": [[IMAGE, 2 * IMAGE], [2 * IMAGE, IMAGE]]},
                   {"size": {"shortest_edge": IMAGE}, "crop_size": {"height": IMAGE, "width": IMAGE},
                    "image_grid_pinpoints": [[IMAGE, 2 * IMAGE], [2 * IMAGE, IMAGE]]}),
    "idefics3": (["<fake_token_around_image>", "<image>", "<global-img>"], "<image>",
                 {"vision_config": {"image_size": IMAGE, "patch_size": 14}},
                 {"size": {"longest_edge": IMAGE}, "max_image_size": {"longest_edge": IMAGE},
                  "do_image_splitting": False}),
    "vipllava": (["<image>"], "<image>",
                 {"vision_config": {"image_size": IMAGE, "patch_size": 14, "num_hidden_layers": 5, "projection_dim": 32},
                  "vision_feature_layers": [-2, -5]},
                 {"size": {"shortest_edge": IMAGE}, "crop_size": {"height": IMAGE, "width": IMAGE}}),
    "llava_onevision": (["<image>", "<video>"], "<image>",
                        {"vision_config": {"image_size": IMAGE, "patch_size": 14},
                         "image_grid_pinpoints": [[IMAGE, 2 * IMAGE], [2 * IMAGE, IMAGE]]},
                        {"size": {"height": IMAGE, "width": IMAGE}, "image_grid_pinpoints": [[IMAGE, 2 * IMAGE], [2 * IMAGE, IMAGE]]}),
    "qwen2_vl": (["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"],
                 "<|vision_start|><|image_pad|><|vision_end|>",
                 {"text_config": {"rope_parameters": {"mrope_section": [2, 3, 3]}},
                  "vision_config": {"embed_dim": 32, "hidden_size": 64}},
                 {"min_pixels": 28 * 28, "max_pixels": 56 * 56}),
    # 4 decoder layers and 3 vision blocks, each block's features added after one of the first 3 decoder
    # layers (deepstack_visual_indexes [8, 16, 24] of its 27 blocks, cut with them); 4 image tokens an image
    "qwen3_vl": (["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"],
                 "<|vision_start|><|image_pad|><|vision_end|>",
                 {"text_config": {"num_hidden_layers": 4, "rope_parameters": {"mrope_section": [4, 2, 2]}},
                  "vision_config": {"out_hidden_size": 64, "depth": 3, "deepstack_visual_indexes": [0, 1, 2]}},
                 {"min_pixels": 64 * 64, "max_pixels": 64 * 64, "patch_size": 16}),
    # a 28-pixel image: one tile of 2 x 2 patches, pixel-shuffled (downsample_ratio 0.5) into one image token
    "internvl": (["<img>", "</img>", "<IMG_CONTEXT>", "<video>"], "<IMG_CONTEXT>",
                 {"vision_config": {"image_size": [IMAGE, IMAGE], "patch_size": [14, 14]}, "image_seq_length": 1},
                 {"size": {"height": IMAGE, "width": IMAGE}}),
    "glm4v": (GLM4V_TOKENS, "<|begin_of_image|><|image|><|end_of_image|>",
              {"text_config": {"rope_parameters": {"mrope_section": [2, 3, 3]}}, "vision_config": {"out_hidden_size": 64}},
              {"size": {"shortest_edge": 28 * 28, "longest_edge": 56 * 56}}),
    # a 28-pixel image: one tile of 2 x 2 patches, pixel-shuffled (downsample_factor 2) into one image token;
    # Cohere 2's decoder: 3 sliding-window layers, then one of global attention
    "aya_vision": (["<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>", "TILE", "TILE_GLOBAL"],
                   "<image>", {"text_config": {"num_hidden_layers": 4, "sliding_window": 8},
                               "vision_config": {"image_size": IMAGE, "patch_size": 14}},
                   {"size": {"height": IMAGE, "width": IMAGE}}),
    # LightOnOCR: Mistral 3's Pixtral tower, patch merger and projector (a 28-pixel image: one merged patch, one
    # image token), Qwen3's decoder
    "lighton_ocr": (["<|image_pad|>", "<|vision_pad|>", "<|vision_end|>"], "<|image_pad|>",
                    {"vision_config": {"image_size": IMAGE, "patch_size": 14}, "spatial_merge_size": 2},
                    {"patch_size": 14, "size": {"longest_edge": IMAGE}}),
    # PaddleOCR-VL: a SigLIP-like tower over each image's patch grid, 2 x 2 merged, 3D rotary positions from the
    # image grids, ERNIE 4.5's decoder
    "paddleocr_vl": (["<|IMAGE_START|>", "<|IMAGE_PLACEHOLDER|>", "<|IMAGE_END|>", "<|VIDEO_PLACEHOLDER|>"],
                     "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>",
                     {"text_config": {"rope_parameters": {"mrope_section": [2, 3, 3]}},
                      "vision_config": {"image_size": IMAGE, "patch_size": 14}},
                     {"min_pixels": 28 * 28, "max_pixels": 56 * 56}),
    # HunyuanOCR (hunyuan_vl): a tower over each image's patch grid of 16 pixels, 2 x 2 merged with a token closing
    # each row and two around the image (a 32-pixel image: 4 image tokens), HunYuan's decoder with rotary positions
    # on 4 axes (the sequence, the image's width and height, the image's index)
    "hunyuan_vl": (["<hy_image_start>", "<hy_image>", "<hy_image_end>"], "<hy_image_start><hy_image><hy_image_end>",
                   {"text_config": {"rope_parameters": {"mrope_section": [2, 2, 2, 2]}},
                    "vision_config": {"num_key_value_heads": 2, "out_hidden_size": 64, "text_hidden_size": 64}},
                   {"size": {"shortest_edge": 32 * 32, "longest_edge": 32 * 32}}),
    # the processors of these need torchvision, which the CPU machines lack: no processor files; their
    # micro-batches are made by hand (hand_made_batches)
    "mistral3": (["[IMG]", "[IMG_BREAK]", "[IMG_END]"], "[IMG]",
                 {"vision_config": {"image_size": IMAGE, "patch_size": 14}, "spatial_merge_size": 2}, None),
    # a SigLIP tower with its (unused) pooling head, pixel-shuffled (downsample_factor 2); Cohere 2's decoder
    "cohere2_vision": (["<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>"], "<|IMG_PATCH|>",
                       {"text_config": {"num_hidden_layers": 4, "sliding_window": 8},
                        "vision_config": {"image_size": IMAGE, "patch_size": 14}, "alignment_intermediate_size": 64},
                       None),
    # a SigLIP 2 (NaFlex) tower over an image's patches as they come, pixel-unshuffled (downsample_factor 2);
    # LFM2's decoder: a short-convolution layer, then one of attention
    "lfm2_vl": (["<|image_start|>", "<image>", "<|image_end|>"], "<image>",
                {"text_config": {"layer_types": ["conv", "full_attention"]},
                 "vision_config": {"patch_size": 16, "num_patches": 16}, "projector_hidden_size": 64}, None),
    # Gemma 4: a tower of 16-pixel patches at their 2D positions, pooled 3 x 3 into an image token; its
    # decoder: per-layer inputs, a sliding-window layer, then a full-attention one with wider heads
    "gemma4": (["<start_of_image>", "<end_of_image>", "<image_soft_token>", "<|video|>", "<audio_soft_token>",
                "<start_of_audio>", "<end_of_audio>"], "<start_of_image>",
               {"text_config": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8,
                                "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": TEXT["vocab_size"],
                                "per_layer_config": {1: {"head_dim": 32}}},
                "vision_config": {"num_key_value_heads": 2, "position_embedding_size": 64}}, None),
    # MiniCPM-V 4.6: a SigLIP-like tower whose window-attention merger (after its first layer here) merges 2 x 2
    # patches, a merger of 2 x 2 more into an image token, Qwen3.5's decoder
    "minicpmv4_6": (["<image>", "</image>", "<|image_pad|>"], "<image>",
                    {"text_config": QWEN3_5_TEXT, "insert_layer_id": 0,
                     "vision_config": {"image_size": 56, "patch_size": 14, "num_hidden_layers": 2}}, None),
    # MiniCPM-V 4.7: 4.6's model, its decoder's 3D rotary positions laid out over each image's canvas from its patch
    # grid, the image tokens (mm_token_type_ids) and the markers around them
    "minicpmv4_7": (["<image>", "</image>", "<|image_pad|>", "<slice>", "</slice>"], "<image>",
                    {"text_config": QWEN3_5_TEXT, "insert_layer_id": 0,
                     "vision_config": {"image_size": 56, "patch_size": 14, "num_hidden_layers": 2}}, None),
    # GOT-OCR 2: a SAM-like tower (windowed attention, one global layer here) over 16-pixel patches of a 64-pixel
    # image, two strided convolutions into one image token, Qwen2's decoder; its processor writes 256 image tokens
    # a tile (the tower's for its 1024-pixel tiles), too many for the test's rows
    # PaliGemma: a SigLIP tower (28 pixels: 4 image tokens) and a projector to the text width, Gemma's decoder;
    # PaliGemma 2's, Gemma 2's (sliding-window and global layers, soft-capping)
    "paligemma": (["<image>"], "<image>", {"vision_config": {"image_size": IMAGE, "patch_size": 14, "projection_dim": 64},
                                           "projection_dim": 64, "hidden_size": 64}, None),
    "paligemma:2": (["<image>"], "<image>",
                    {"text_config": {"model_type": "gemma2", "sliding_window": 8, "query_pre_attn_scalar": 16},
                     "vision_config": {"image_size": IMAGE, "patch_size": 14, "projection_dim": 64},
                     "projection_dim": 64, "hidden_size": 64}, None),
    # PaliGemma from chat rows through its own processor (its SigLIP image processor: 4 image tokens an image)
    "paligemma:rows": (["<image>", "<bos>"], "<image>", {"vision_config": {"image_size": IMAGE, "patch_size": 14, "projection_dim": 64},
                                                "projection_dim": 64, "hidden_size": 64},
                       {"size": {"height": IMAGE, "width": IMAGE}, "image_seq_length": 4}),
    "got_ocr2": (["<img>", "</img>", "<imgpad>"], "<img><imgpad></img>",
                 {"vision_config": {"image_size": 64, "patch_size": 16, "output_channels": 16, "mlp_dim": 64,
                                    "window_size": 2, "global_attn_indexes": [0]}}, None),
    # Aria: an Idefics3-like tower, a projector of learned queries cross-attending to the patches (one query for an
    # image of 2 x 2 patches here), Aria's decoder of 4 experts (2 a token) beside 2 shared ones; its processor
    # resizes every image to 980 pixels a side (the processor's default, over its image processor's)
    "aria": (["<|img|>"], "<|img|>",
             {"vision_config": {"image_size": IMAGE, "patch_size": 14}, "projector_patch_to_query_dict": {4: 1},
              "text_config": {"moe_num_experts": 4}}, None),
    # MiniCPM-OCR: MiniCPM-V 4.6's model reading 4 times more image tokens (downsample_mode 4x: the tower's
    # window-attention merger left out, the 2 x 2 merger alone)
    "minicpm_ocr": (["<image>", "</image>", "<|image_pad|>"], "<image>",
                    {"text_config": QWEN3_5_TEXT, "vision_config": {"image_size": 56, "patch_size": 14,
                                                                    "num_hidden_layers": 2}}, None),
}
# type -> an image's tokens and its image tensors for a micro-batch of two rows of an image each, as
# its processor makes them for an image of IMAGE pixels a side (Mistral 3: one merged patch; Cohere 2
# Vision: one tile; LFM2-VL: 2 x 2 patches of 16 pixels, a row each, and their grid)
HAND_MADE = {
    "mistral3": ("[IMG][IMG_END]", lambda gen: {"pixel_values": torch.randn(2, 3, IMAGE, IMAGE, generator=gen),
                                                 "image_sizes": torch.tensor([[IMAGE, IMAGE]] * 2)}),
    "cohere2_vision": ("<|START_OF_IMG|><|IMG_PATCH|><|END_OF_IMG|>",
                       lambda gen: {"pixel_values": torch.randn(2, 3, IMAGE, IMAGE, generator=gen)}),
    "lfm2_vl": ("<|image_start|><image><|image_end|>",
                lambda gen: {"pixel_values": torch.randn(2, 4, 3 * 16 * 16, generator=gen),
                             "pixel_attention_mask": torch.ones(2, 4, dtype=torch.int32),
                             "spatial_shapes": torch.tensor([[2, 2]] * 2)}),
    # Gemma 4: an image of 48 pixels a side, 3 x 3 patches of 16 at their (x, y) positions, padded as its
    # processor pads to a budget of patches (here 18: positions -1), pixels in [0, 1]
    "gemma4": ("<start_of_image><image_soft_token><end_of_image>",
               lambda gen: {"pixel_values": torch.cat([torch.rand(2, 9, 3 * 16 * 16, generator=gen),
                                                       torch.zeros(2, 9, 3 * 16 * 16)], dim=1),
                            "image_position_ids": torch.tensor(
                                [[(x, y) for y in range(3) for x in range(3)] + [(-1, -1)] * 9] * 2)}),
    # MiniCPM-V 4.6: an image of 56 pixels a side, 4 x 4 patches of 14 (16 merged into one image token); its
    # processor packs a micro-batch's images side by side into one row of patches, with each one's patch grid
    "minicpmv4_6": ("<image><|image_pad|></image>",
                    lambda gen: {"pixel_values": torch.randn(1, 3, 14, 2 * 16 * 14, generator=gen),
                                 "target_sizes": torch.tensor([[4, 4]] * 2, dtype=torch.int32)}),
    "minicpmv4_7": ("<image><|image_pad|></image>",
                    lambda gen: {"pixel_values": torch.randn(1, 3, 14, 2 * 16 * 14, generator=gen),
                                 "target_sizes": torch.tensor([[4, 4]] * 2, dtype=torch.int32)}),
    # MiniCPM-OCR: an image of 28 pixels a side, 2 x 2 patches of 14 merged into one image token
    "minicpm_ocr": ("<image><|image_pad|></image>",
                    lambda gen: {"pixel_values": torch.randn(1, 3, 14, 2 * 4 * 14, generator=gen),
                                 "target_sizes": torch.tensor([[2, 2]] * 2, dtype=torch.int32)}),
    "got_ocr2": ("<img><imgpad></img>", lambda gen: {"pixel_values": torch.randn(2, 3, 64, 64, generator=gen)}),
    # PaliGemma: its processor writes an image's 4 tokens, and token_type_ids (PREFIX_TYPES)
    "paligemma": ("<image> <image> <image> <image>", lambda gen: {"pixel_values": torch.randn(2, 3, IMAGE, IMAGE, generator=gen)}),
    "paligemma:2": ("<image> <image> <image> <image>",
                    lambda gen: {"pixel_values": torch.randn(2, 3, IMAGE, IMAGE, generator=gen)}),
    "aria": ("<|img|>", lambda gen: {"pixel_values": torch.randn(2, 3, IMAGE, IMAGE, generator=gen),
                                     "pixel_mask": torch.ones(2, IMAGE, IMAGE, dtype=torch.bool)}),
}

# HAND_MADE types whose forward attends bidirectionally over a row's prefix (the image and the prompt) and
# causally over its answer, told apart by token_type_ids (0 and 1), as its processor marks a suffix
PREFIX_TYPES = ("paligemma",)
# a HAND_MADE type whose processor marks its image tokens (mm_token_type_ids: 1) -> its image token
WITH_TOKEN_TYPES = {"minicpmv4_7": "<|image_pad|>"}


def word_tokenizer(directory: Path, specials: list[str], model_type: str = ""):
    """A fast tokenizer of one token a word, with ChatML's and the model's special tokens."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "[UNK]", *WORDS])}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    named = {**{name: token for name, token in NAMED_TOKENS.items() if token in specials},
             **TYPE_NAMED_TOKENS.get(model_type, {})}
    # the tokens a processor reads by name (Gemma 3's tokenizer.boi_token) as extra_special_tokens
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="[UNK]", eos_token="<|im_end|>",
                                   bos_token="<bos>" if "<bos>" in specials else None,  # PaliGemma's processor writes it
                                   extra_special_tokens=named)
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *specials]})
    return fast


NAMED_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>",
                "start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                "video_token": "<video>"}

# a type's tokens that its processor reads by name, where they are not NAMED_TOKENS'
TYPE_NAMED_TOKENS = {"lighton_ocr": {"image_token": "<|image_pad|>", "image_break_token": "<|vision_pad|>",
                                     "image_end_token": "<|vision_end|>"},
                     "paddleocr_vl": {"image_token": "<|IMAGE_PLACEHOLDER|>"},
                     "hunyuan_vl": {"image_token": "<hy_image>", "image_start_token": "<hy_image_start>",
                                    "image_end_token": "<hy_image_end>"}}


def tiny_config(model_type: str, tokenizer) -> dict:
    """The config class's defaults, its sizes cut (TEXT, VISION and the type's), the image tokens
    the tokenizer's ids."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type.split(":")[0]).to_dict()  # `type:variant`: the type's
    specials, _, sizes, _ = TYPES[model_type]
    for part, small in (("text_config", TEXT), ("vision_config", VISION)):
        if config[part] is None:  # an optional part (Gemma 4's tower): its config class's defaults
            config[part] = type(AutoConfig.for_model(model_type.split(":")[0])).sub_configs[part]().to_dict()
        config[part].update({k: v for k, v in small.items() if k in config[part]})
        for key, value in sizes.get(part, {}).items():
            config[part][key] = {**config[part][key], **value} if isinstance(value, dict) else value
        layers = config[part].get("num_hidden_layers")
        if isinstance(config[part].get("layer_types"), list):
            config[part]["layer_types"] = config[part]["layer_types"][:layers]
        if isinstance(config[part].get("per_layer_config"), dict):  # a layer's own sizes (Gemma 4's), of the layers kept
            config[part]["per_layer_config"] = {k: v for k, v in config[part]["per_layer_config"].items()
                                                if int(k) < layers}
    for key, value in sizes.items():  # a third part's sizes (Idefics2's perceiver_config) merged into its defaults
        if key not in ("text_config", "vision_config"):
            config[key] = {**config[key], **value} if isinstance(value, dict) and isinstance(config.get(key), dict) else value
    for key, value in list(config.items()):
        if isinstance(TYPE_TOKEN_KEYS.get(model_type, {}).get(key), list):  # a list of token ids (Ovis2's indicators)
            config[key] = tokenizer.convert_tokens_to_ids(TYPE_TOKEN_KEYS[model_type][key])
        elif (key.endswith(("token_id", "token_index")) and isinstance(value, int)) or key in TYPE_TOKEN_KEYS.get(model_type, {}):
            token = {**TOKEN_KEYS, **TYPE_TOKEN_KEYS.get(model_type, {})}.get(key)
            config[key] = tokenizer.convert_tokens_to_ids(token) if token in specials else min(value, TEXT["vocab_size"] - 1)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(config["text_config"].get(key), int):
            config["text_config"][key] = min(config["text_config"][key], TEXT["vocab_size"] - 1)
    return {k: v for k, v in config.items() if k not in ("transformers_version", "architectures")}


def save_processor(model_type: str, tokenizer, chat_template: str, directory: Path) -> None:
    """The model's processor's files as its makers publish them: its own (PIL) image processor's
    preprocessor_config.json, the tokenizer, processor_config.json and chat_template.jinja."""
    from transformers.models.auto.image_processing_auto import (IMAGE_PROCESSOR_MAPPING_NAMES,
                                                                get_image_processor_class_from_name)
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    image_sizes, extra = TYPES[model_type][3], PROCESSOR_KWARGS.get(model_type, {})
    names = IMAGE_PROCESSOR_MAPPING_NAMES[IMAGE_PROCESSOR_OF.get(model_type, model_type.split(":")[0])]
    image_processor = get_image_processor_class_from_name(names["pil"])(**image_sizes)
    image_processor.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    (directory / "chat_template.jinja").write_text(chat_template)
    (directory / "processor_config.json").write_text(json.dumps(
        {"processor_class": PROCESSOR_CLASS_OF.get(model_type) or PROCESSOR_MAPPING_NAMES[model_type.split(":")[0]],
         **extra}))


PROCESSOR_KWARGS = {"llava": {"patch_size": 14, "vision_feature_select_strategy": "default",
                              "num_additional_image_tokens": 1},
                    "gemma3": {"image_seq_length": 4},
                    "llava_next": {"patch_size": 14, "vision_feature_select_strategy": "default",
                                   "num_additional_image_tokens": 1},
                    "idefics3": {"image_seq_len": 1},
                    "vipllava": {"patch_size": 14, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1},
                    "llava_onevision": {"vision_feature_select_strategy": "full", "num_image_tokens": 4},
                    "internvl": {"image_seq_length": 1},
                    "aya_vision": {"img_size": IMAGE, "patch_size": 14, "downsample_factor": 2},
                    "lighton_ocr": {"patch_size": 14, "spatial_merge_size": 2}}
# SmolVLM is Idefics3's model with a processor of its own (SmolVLMProcessor): the same tiny sizes,
# tokens and processor settings
for by_type in (TYPES, TYPE_TOKEN_KEYS, PROCESSOR_KWARGS):
    by_type["smolvlm"] = by_type["idefics3"]
# Qwen3-VL-MoE: Qwen3-VL's tower, tokens and image processor, a decoder of 4 experts (2 a token)
TYPES["qwen3_vl_moe"] = (*TYPES["qwen3_vl"][:2], {**TYPES["qwen3_vl"][2], "text_config": {
    **TYPES["qwen3_vl"][2]["text_config"], "num_local_experts": 4, "moe_intermediate_size": 32, "num_experts_per_tok": 2}},
    TYPES["qwen3_vl"][3])
# Qwen3.5: Qwen3-VL's tokens and processor, no deepstack; a decoder of a linear-attention (gated
# delta rule: transformers' torch code for it is slow on the CPU, so one such layer, not 3 a full one)
# layer and one of full attention, a quarter of each head rotated (its 3D rotary positions interleaved
# over the rotated quarter's 4 frequencies); Qwen3.5-MoE with 4 experts
TYPES["qwen3_5"] = (*TYPES["qwen3_vl"][:2], {"text_config": QWEN3_5_TEXT, "vision_config": {"out_hidden_size": 64}},
                    TYPES["qwen3_vl"][3])
TYPES["qwen3_5_moe"] = (*TYPES["qwen3_vl"][:2], {"vision_config": {"out_hidden_size": 64}, "text_config": {
    **QWEN3_5_TEXT, "num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "num_experts_per_tok": 2}}, TYPES["qwen3_vl"][3])
# GLM-4.5V (glm4v_moe): GLM-4V's tower, tokens and processor; a decoder whose first layer is dense, the
# second of 4 experts (2 a token) and a shared one, half of each head rotated
TYPES["glm4v_moe"] = (*TYPES["glm4v"][:2], {**TYPES["glm4v"][2], "text_config": {
    "rope_parameters": {"mrope_section": [1, 1, 2]}, "n_routed_experts": 4, "moe_intermediate_size": 32,
    "num_experts_per_tok": 2}}, TYPES["glm4v"][3])
TYPE_TOKEN_KEYS["glm4v_moe"] = TYPE_TOKEN_KEYS["glm4v"]
# GLM-4.6V: GLM-4V's tower, decoder, tokens and sizes, a processor of its own
for by_type in (TYPES, TYPE_TOKEN_KEYS):
    by_type["glm46v"] = by_type["glm4v"]
# EXAONE 4.5: a Qwen2.5-VL-like tower (windowed attention, 2D rotary positions) and merger, Qwen2-VL's
# tokens and image processor, EXAONE 4's decoder: a sliding-window layer, then one of global attention
TYPES["exaone4_5"] = (*TYPES["qwen2_vl"][:2], {"text_config": {"layer_types": ["sliding_attention", "full_attention"],
                                                               "sliding_window": 8},
                                               "vision_config": {"out_hidden_size": 64, "fullatt_block_indexes": [0],
                                                                                 "num_key_value_heads": 1}},
                      TYPES["qwen2_vl"][3])
# LFM3-VL: a tower of short-convolution and attention layers over 16-pixel patches and a merger, Qwen2-VL's
# tokens and image processor; LFM3's decoder: a short-convolution layer, then one of attention
TYPES["lfm3_vl"] = (*TYPES["qwen2_vl"][:2], {"text_config": {"layer_types": ["conv", "full_attention"]},
                                             "vision_config": {"layer_types": ["conv", "full_attention"],
                                                               "num_hidden_layers": 2, "num_key_value_heads": 1},
                                             "projector_hidden_size": 64},
                    {**TYPES["qwen2_vl"][3], "patch_size": 16, "min_pixels": 32 * 32, "max_pixels": 64 * 64})
# HyperCLOVA X SEED (hyperclovax_vision_v2): Qwen2.5-VL's tower and merger, tokens and image processor, the
# HyperCLOVA X decoder (1D positions, its multipliers, a norm after each sublayer)
TYPES["hyperclovax_vision_v2"] = (*TYPES["qwen2_5_vl"][:2], {**TYPES["qwen2_5_vl"][2], "text_config": {}},
                                  TYPES["qwen2_5_vl"][3])
# LLaVA-NeXT-Video: LLaVA-NeXT's model, tokens and sizes (image rows only), a processor of its own
TYPES["llava_next_video"] = (["<image>", "<video>"], *TYPES["llava_next"][1:])
TYPE_TOKEN_KEYS["llava_next_video"] = {"video_token_index": "<video>"}
PROCESSOR_KWARGS["llava_next_video"] = {**PROCESSOR_KWARGS["llava_next"], "image_token": "<image>", "video_token": "<video>"}
# Video-LLaVA: a CLIP tower and projector (images and videos through the one tower); image rows only
TYPES["video_llava"] = (["<image>", "<video>"], "<image>",
                        {"vision_config": {"image_size": IMAGE, "patch_size": 14, "num_hidden_layers": 2,
                                           "projection_dim": 32}},
                        {"size": {"shortest_edge": IMAGE}, "crop_size": {"height": IMAGE, "width": IMAGE}})
TYPE_TOKEN_KEYS["video_llava"] = {"video_token_index": "<video>"}
PROCESSOR_KWARGS["video_llava"] = PROCESSOR_KWARGS["llava"]
# Idefics2: a SigLIP-like tower and a perceiver resampler of a few latents (here one: one image token an image)
TYPES["idefics2"] = (["<fake_token_around_image>", "<image>", "<end_of_utterance>"], "<image>",
                     {"vision_config": {"image_size": IMAGE, "patch_size": 14},
                      "perceiver_config": {"resampler_n_latents": 1, "resampler_depth": 1, "resampler_n_heads": 2,
                                           "resampler_head_dim": 16, "num_key_value_heads": 1}},
                     {"size": {"shortest_edge": IMAGE, "longest_edge": IMAGE}, "do_image_splitting": False})
TYPE_TOKEN_KEYS["idefics2"] = {"image_token_id": "<image>"}
PROCESSOR_KWARGS["idefics2"] = {"image_seq_len": 1}
# Granite-Docling: an Idefics3-like SigLIP tower over 64-pixel tiles of 16-pixel patches, pixel-shuffled 4 x 4 into
# one image token, deepstack features of 3 of its blocks added after the first 3 of 4 decoder layers
TYPES["granite_docling"] = (["<fake_token_around_image>", "<image>", "<global-img>"], "<image>",
                            {"text_config": {"num_hidden_layers": 4},
                             "vision_config": {"image_size": 64, "patch_size": 16, "num_hidden_layers": 3,
                                               "deepstack_visual_indexes": [0, 1, 2], "out_hidden_size": 64}},
                            {"size": {"height": 64, "width": 64}, "crop_to_patches": False})
TYPE_TOKEN_KEYS["granite_docling"] = {"image_token_id": "<image>"}
PROCESSOR_KWARGS["granite_docling"] = {"image_seq_len": 1}
# DeepSeek-VL: a SigLIP tower (with its unused pooling head) and a two-layer aligner, one image token a patch
TYPES["deepseek_vl"] = (["<image_placeholder>"], "<image_placeholder>",
                        {"vision_config": {"image_size": IMAGE, "patch_size": 14}},
                        {"size": {"height": IMAGE, "width": IMAGE}})
TYPE_TOKEN_KEYS["deepseek_vl"] = {"image_token_id": "<image_placeholder>"}
TYPE_NAMED_TOKENS["deepseek_vl"] = {"image_token": "<image_placeholder>"}
PROCESSOR_KWARGS["deepseek_vl"] = {"num_image_tokens": 4}
# Janus: a SigLIP-like tower and an aligner for understanding (its image-generation VQ model and heads, untouched
# by an image-text row, are carried as the tower is)
TYPES["janus"] = (["<image_placeholder>", "<begin_of_image>", "<end_of_image>"], "<image_placeholder>",
                  {"vision_config": {"image_size": 32, "patch_size": 16, "num_image_tokens": 4, "projection_dim": 64},
                   "vq_config": {"num_embeddings": 32, "embed_dim": 8, "latent_channels": 32, "base_channels": 32,
                                 "channel_multiplier": [1, 2], "num_res_blocks": 1, "num_patches": 2,
                                 "projection_dim": 64, "image_token_embed_dim": 64}},
                  {"size": {"height": 32, "width": 32}})
TYPE_TOKEN_KEYS["janus"] = {"image_token_id": "<image_placeholder>"}
TYPE_NAMED_TOKENS["janus"] = {"image_token": "<image_placeholder>", "boi_token": "<begin_of_image>",
                              "eoi_token": "<end_of_image>"}
PROCESSOR_KWARGS["janus"] = {"num_image_tokens": 4}
# Ovis2: a SigLIP-like tower whose patches become probabilities over a visual vocabulary, embedded by its table
# (5 indicator tokens around an image's tiles), Qwen2's decoder
OVIS2_INDICATORS = ["<IMG_START>", "<IMG_GRID>", "<IMG_COL>", "<IMG_ROW>", "<IMG_END>"]
TYPES["ovis2"] = (["<image>", "<IMG_ATOM>", *OVIS2_INDICATORS], "<image>",
                  {"vision_config": {"image_size": IMAGE, "patch_size": 14, "vocab_size": 32}, "vocab_size": 32,
                   "hidden_size": TEXT["hidden_size"]},
                  {"size": {"height": IMAGE, "width": IMAGE}})
TYPE_TOKEN_KEYS["ovis2"] = {"image_token_id": "<IMG_ATOM>", "visual_indicator_token_ids": OVIS2_INDICATORS}
PROCESSOR_KWARGS["ovis2"] = {"image_seq_length": 4}
# VideoLLaMA3 (image rows): a SigLIP-like tower over each image's patch grid with 2D rotary positions and a
# projector, Qwen2's decoder; Qwen2-VL's tokens
TYPES["video_llama_3"] = (["<|image_pad|>", "<|video_pad|>"], "<|image_pad|>",
                          {"vision_config": {"patch_size": 14}},
                          {"size": {"shortest_edge": IMAGE * IMAGE, "longest_edge": 56 * 56}})
# GLM-OCR: a GLM-4V-like tower and merger (3D rotary positions from the image grids), GLM-4's decoder, GLM-4V's
# tokens and sizes; no processor of its own: its directory names GLM-4V's
for by_type in (TYPES, TYPE_TOKEN_KEYS):
    by_type["glm_ocr"] = by_type["glm4v"]
PROCESSOR_CLASS_OF = {"glm_ocr": "Glm4vProcessor"}  # a type's processor where transformers names none for it
# Cosmos3-Edge: a SigLIP-like tower over each image's grid of 16-pixel patches (a 32-pixel image: 2 x 2, merged
# into one image token) and a projector, 3D rotary positions from the image grids, its decoder; Qwen2-VL's tokens
TYPES["cosmos3_edge"] = (TYPES["qwen2_vl"][0], TYPES["qwen2_vl"][1],
                         {"text_config": {"rope_parameters": {"mrope_section": [2, 3, 3]}},
                          "vision_config": {"patch_size": 16, "num_patches": 16}, "projector_hidden_size": 64},
                         {"size": {"shortest_edge": 32 * 32, "longest_edge": 32 * 32}})
# Cosmos3-Omni: Qwen3-VL's tower, deepstack and decoder, tokens and sizes; GLM-GA (glmga): GLM-4.6V's model, GLM-4V's
# tokens and sizes, an image processor of its own; neither has a processor of its own: their directories name Qwen3-VL's
# and GLM-4.6V's
TYPES["cosmos3_omni"] = TYPES["qwen3_vl"]
for by_type in (TYPES, TYPE_TOKEN_KEYS):
    by_type["glmga"] = by_type["glm4v"]
PROCESSOR_CLASS_OF.update({"cosmos3_omni": "Qwen3VLProcessor", "glmga": "Glm46VProcessor"})
# DeepSeek-VL-Hybrid: DeepSeek-VL's SigLIP tower (2 x 2 patches of a 32-pixel image) beside a SAM tower over the image
# at a higher resolution (64 pixels here), their features joined by the aligner
TYPES["deepseek_vl_hybrid"] = (["<image_placeholder>"], "<image_placeholder>",
                               {"vision_config": {"image_size": 32, "patch_size": 16},
                                "high_res_vision_config": {"hidden_size": 32, "output_channels": 16, "num_hidden_layers": 1,
                                                           "num_attention_heads": 2, "image_size": 64, "patch_size": 16,
                                                           "window_size": 2, "global_attn_indexes": [0], "mlp_dim": 64}},
                               {"size": {"height": 32, "width": 32}, "high_res_size": {"height": 64, "width": 64}})
TYPE_TOKEN_KEYS["deepseek_vl_hybrid"] = TYPE_TOKEN_KEYS["deepseek_vl"]
TYPE_NAMED_TOKENS["deepseek_vl_hybrid"] = TYPE_NAMED_TOKENS["deepseek_vl"]
PROCESSOR_KWARGS["deepseek_vl_hybrid"] = PROCESSOR_KWARGS["deepseek_vl"]
# PP-Chart2Table: GOT-OCR 2's model (its sizes and tokens), a processor of its own whose chat template writes the
# image tokens
TYPES["pp_chart2table"] = (TYPES["got_ocr2"][0], TYPES["got_ocr2"][1], TYPES["got_ocr2"][2],
                           {"size": {"height": 64, "width": 64}})
TYPE_TOKEN_KEYS["pp_chart2table"] = TYPE_TOKEN_KEYS["got_ocr2"]
IMAGE_PROCESSOR_OF = {"glm_ocr": "glm4v", "cosmos3_omni": "qwen3_vl", "qwen3_vl_moe": "qwen3_vl", "glm4v_moe": "glm4v", "exaone4_5": "qwen2_vl", "lfm3_vl": "qwen2_vl"}  # a type with no image processor of its own
WITH_PROCESSOR = [t for t, spec in TYPES.items() if spec[3] is not None]


def tiny_model_dir(model_type: str, directory: Path, seed: int = 0):
    """The saved tiny model with its processor's files; returns (model, directory)."""
    from transformers import AutoModelForImageTextToText

    from megatrain_ray.models.transformers.modules import config_object

    directory.mkdir(parents=True, exist_ok=True)
    specials, placeholder, _, _ = TYPES[model_type]
    tokenizer = word_tokenizer(directory, specials, model_type)
    config = tiny_config(model_type, tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config_object(config), dtype=torch.float32,
                                                    attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(1.0 if p.abs().sum() > 0 else 0.0, 0.3)
    model.save_pretrained(directory)
    if TYPES[model_type][3] is not None:
        save_processor(model_type, tokenizer, CHATML.replace("IMAGE", placeholder), directory)
    else:
        tokenizer.save_pretrained(directory)
    return model, directory


def hand_made_batches(model_type: str, model_dir: Path, steps: int, seed: int = 0) -> list[list[dict[str, torch.Tensor]]]:
    """A HAND_MADE type's micro-batches as its processor makes them, for an image of IMAGE pixels a
    side (Mistral 3: `[IMG][IMG_END]`, one merged patch): two rows of a question with an image and an
    answer, the loss on the answer and its end of turn; pixel values random."""
    from transformers import AutoTokenizer

    image, image_tensors = HAND_MADE[model_type]
    tok = AutoTokenizer.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        rows, labels, starts = [], [], []
        for _ in range(2):
            prompt = tok(f"<|im_start|>user {image} " + " ".join(rng.choice(WORDS, 3)) + "<|im_end|> "
                         "<|im_start|>assistant")["input_ids"]
            answer = tok(" ".join(rng.choice(WORDS, 3)) + "<|im_end|>")["input_ids"]
            ids = (prompt + answer + [0] * 16)[:16]
            target = [-100] * len(prompt) + answer + [-100] * 16
            rows.append(ids)
            starts.append(len(prompt))
            labels.append((target[1:] + [-100])[:16])
        mb = {"input_ids": torch.tensor(rows), "labels": torch.tensor(labels),
              "position_ids": torch.arange(16).expand(2, 16).contiguous(), **image_tensors(gen)}
        if model_type.split(":")[0] in PREFIX_TYPES:  # the answer (and the padding after it) attended causally
            mb["token_type_ids"] = (torch.arange(16) >= torch.tensor(starts)[:, None]).long()
        if model_type in WITH_TOKEN_TYPES:  # the processor's marks of the image tokens
            mb["mm_token_type_ids"] = (mb["input_ids"] == tok.convert_tokens_to_ids(WITH_TOKEN_TYPES[model_type])).long()
        out.append([mb])
    return out


def write_images(directory: Path, count: int, seed: int = 0) -> list[str]:
    """`count` random RGB images of IMAGE x IMAGE pixels as PNG files."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        path = directory / f"image{i}.png"
        Image.fromarray(rng.integers(0, 256, (IMAGE, IMAGE, 3), dtype=np.uint8)).save(path)
        paths.append(str(path))
    return paths


def write_rows(path: Path, images: list[str], count: int, seed: int = 0, broken: int = 0) -> Path:
    """ShareGPT rows as LlamaFactory writes them: `messages` with `<image>` placeholders, `images`
    paths; the last `broken` rows name an image file that does not exist."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(count):
        question = " ".join(rng.choice(WORDS, 3))
        answer = " ".join(rng.choice(WORDS, int(rng.integers(2, 5))))
        image = images[i % len(images)] if i < count - broken else str(path.parent / "missing.png")
        rows.append({"messages": [{"role": "user", "content": f"<image>{question}"},
                                  {"role": "assistant", "content": answer}], "images": [image]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
