"""Image-text models (AutoModelForImageTextToText) through transformers' own modules: what their
micro-batches carry and which of them train.

The language decoder streams as any decoder of the transformers family (models/transformers/). The
vision tower and projector are part of the embedding layer: everything the model's own forward
runs before its first decoder layer, so the step runs them on the worker's device, from the
micro-batch's image tensors (the model's processor made them: data/image_text.py), and their
features replace the image tokens' embeddings as the model's forward puts them. They are frozen
(no gradient, no weight decay: AdamW leaves them as they are) unless model.train_vision.

Positions and masks are the model's own: each micro-batch's layer arguments are recorded from the
model's forward on the micro-batch's token ids without the images (Qwen2.5-VL's 3D rotary
positions from the image grids, Gemma 3's bidirectional attention within an image).

Qwen3-VL's deepstack features (maps of the tower's inner blocks that its decoder adds at the image
tokens after each of its first layers) are what the model's forward hands its language model; the
embedding layer places them behind the hidden states, and each of those layers adds its own
(models/transformers/forward.py, deepstack_features).

The tower's device memory (the planner's line for it, planning/memory.py) is computed from its
config: it runs a micro-batch at a time, on at most one patch group per position of the micro-batch
(every token an image token), its forward's largest layer alive at once when frozen, every layer's
activations kept for backward when it trains.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# the micro-batch's keys that are not the model's inputs
NOT_INPUTS = ("labels", "position_ids")
# the model's inputs that only its vision tower reads (the rest make the positions and masks), beside
# any other pixel values (DeepSeek-VL-Hybrid's high_res_pixel_values: is_pixels)
PIXEL_KEYS = ("pixel_values", "pixel_attention_mask")

# model_type -> the structure covered (tested against transformers, tests/models/test_image_text.py)
COVERED = {
    "qwen2_vl": "a Qwen2-VL vision tower and merger, 3D rotary positions from the image grids",
    "qwen2_5_vl": "a Qwen2.5-VL vision tower and merger, 3D rotary positions from the image grids",
    "gemma3": "a SigLIP tower and projector, bidirectional attention within each image",
    "llava": "a CLIP tower and projector",
    "llava_next": "a CLIP tower over image tiles, a projector and the image-newline embedding",
    "idefics3": "a SigLIP-like tower over image tiles, a pixel-shuffle connector",
    "vipllava": "a CLIP tower, features of several of its layers, a projector",
    "llava_onevision": "a SigLIP tower over image tiles, a projector and the image-newline embedding",
    "smolvlm": "Idefics3's tower and pixel-shuffle connector (its processor needs num2words)",
    "mistral3": "a Pixtral tower, patch merger and projector",
    "qwen3_vl": "a Qwen3-VL vision tower and merger, 3D rotary positions, deepstack features added after the "
                "first decoder layers",
    "qwen3_vl_moe": "Qwen3-VL's vision tower and deepstack, a decoder with experts",
    "internvl": "an InternViT tower, a pixel-shuffle projector",
    "glm4v": "a GLM-4V vision tower and merger, 3D rotary positions from the image grids",
    "glm4v_moe": "GLM-4V's vision tower and merger, a decoder with experts beside a shared one",
    "aya_vision": "a SigLIP tower, a pixel-shuffle projector, Cohere 2's decoder",
    "cohere2_vision": "a SigLIP tower, a pixel-shuffle projector, Cohere 2's decoder (its image processor needs "
                      "torchvision)",
    "lfm2_vl": "a SigLIP 2 (NaFlex) tower over each image's own patch grid, a pixel-unshuffle projector, LFM2's "
               "decoder of short-convolution and attention layers (its image processor needs torchvision)",
    "glm46v": "GLM-4V's vision tower, merger and decoder",
    "qwen3_5": "Qwen3-VL's vision tower and merger without deepstack, 3D rotary positions on a quarter of each "
               "head, a decoder of linear-attention (gated delta rule) layers and full-attention ones",
    "qwen3_5_moe": "Qwen3.5's vision tower and decoder, its MLPs experts beside a shared expert",
    "exaone4_5": "a Qwen2.5-VL-like vision tower (windowed attention, 2D rotary positions) and merger, EXAONE 4's "
                 "decoder of sliding-window and global attention layers",
    "gemma4": "a tower of patches at their 2D positions pooled into image tokens, Gemma 4's decoder with per-layer "
              "inputs (its image processor's PIL path pads each image's patches to a budget of hundreds)",
    "hyperclovax_vision_v2": "Qwen2.5-VL's vision tower and merger, HyperCLOVA X's decoder (1D positions, scaling "
                             "multipliers, a norm after each sublayer)",
    "lighton_ocr": "Mistral 3's Pixtral tower, patch merger and projector, Qwen3's decoder",
    "paddleocr_vl": "a SigLIP-like tower over each image's patch grid, 2 x 2 merged, and a projector, 3D rotary "
                    "positions from the image grids, ERNIE 4.5's decoder",
    "hunyuan_vl": "a tower over each image's patch grid, 2 x 2 merged, with learned tokens closing each row and "
                  "around the image, HunYuan's decoder",
    "llava_next_video": "LLaVA-NeXT's CLIP tower over image tiles, projector and image-newline embedding (image rows)",
    "video_llava": "a CLIP tower and projector (image rows)",
    "idefics2": "a SigLIP-like tower and a perceiver resampler of learned latents",
    "granite_docling": "an Idefics3-like SigLIP tower over image tiles, a pixel-shuffle connector, deepstack "
                       "features of inner blocks added after the first decoder layers, Granite's decoder",
    "deepseek_vl": "a SigLIP tower and a two-layer aligner, Llama's decoder",
    "janus": "a SigLIP-like tower and an aligner (its image-generation VQ model and heads belong to the tower), "
             "Llama's decoder",
    "minicpmv4_6": "a SigLIP-like tower with a window-attention merger between its layers, a merger of 2 x 2 "
                   "patches, Qwen3.5's decoder (its processor needs torchvision)",
    "minicpmv4_7": "MiniCPM-V 4.6's tower and mergers, Qwen3.5's decoder with 3D rotary positions over each image's "
                   "canvas (its processor needs torchvision)",
    "got_ocr2": "a SAM-like tower of windowed and global attention, two strided convolutions and a projector, "
                "Qwen2's decoder",
    "aria": "an Idefics3-like tower, a projector of learned queries cross-attending to the patches, a decoder of "
            "experts beside shared ones",
    "ovis2": "a SigLIP-like tower whose patches become probabilities over a visual vocabulary embedded by a table, "
             "indicator tokens around each image, Qwen2's decoder",
    "video_llama_3": "a SigLIP-like tower over each image's patch grid with 2D rotary positions, a projector, "
                     "Qwen2's decoder (image rows)",
    "glm_ocr": "a GLM-4V-like vision tower and merger, 3D rotary positions from the image grids, GLM-4's decoder "
               "(GLM-4V's processor)",
    "cosmos3_edge": "a SigLIP-like tower over each image's patch grid, 2 x 2 merged, and a projector, 3D rotary "
                    "positions from the image grids, its decoder",
    "cosmos3_omni": "Qwen3-VL's vision tower, merger, deepstack features and decoder (Qwen3-VL's processor)",
    "glmga": "GLM-4.6V's vision tower, merger and decoder (GLM-4.6V's processor)",
    "deepseek_vl_hybrid": "DeepSeek-VL's SigLIP tower beside a SAM tower over the image at a higher resolution, "
                          "their features joined by an aligner, Llama's decoder",
    "minicpm_ocr": "MiniCPM-V 4.6's tower and merger reading 4 times more image tokens (its window-attention "
                   "merger left out), Qwen3.5's decoder (its processor needs torchvision)",
    "pp_chart2table": "GOT-OCR 2's SAM-like tower, strided convolutions and projector, Qwen2's decoder",
    "lfm3_vl": "a vision tower of short-convolution and attention layers and a merger, LFM3's decoder of "
               "short-convolution and attention layers",
    "paligemma": "a SigLIP tower and a projector, Gemma's or (PaliGemma 2) Gemma 2's decoder, attending "
                 "bidirectionally over a row's image and prompt and causally over its answer (token_type_ids)",
}


# Per patch, in elements of the compute dtype, x the tower's width and x its MLP's: a frozen tower's
# forward at its peak (one layer's tensors), and per layer of a trained tower what its forward keeps
# for backward with the backward's own. Upper bounds of the peaks torch's memory tracker
# (torch.distributed._tools.mem_tracker) measures on the CPU in fp32 for the towers of Qwen2-VL,
# Qwen2.5-VL, Qwen3-VL, CLIP and SigLIP (2 layers of width 128, 1k and 4k patches): frozen 15.5, 11.6,
# 12.1, 16.0 and 10.7 widths a patch beside its pixels, trained 29.1, 28.8, 22.6, 25.4 and 18.7 a
# layer; tower_bytes comes to 1.2 to 1.8 times each of those peaks.
TOWER_FORWARD_PER_PATCH = (8, 2)
TOWER_KEPT_PER_PATCH_LAYER = (20, 4)


def refusal(config: dict[str, Any]) -> str | None:
    """Why an image-text model whose structure the transformers family runs cannot train here, in
    one paragraph; None for a covered type."""
    model_type = config.get("model_type")
    if model_type not in COVERED:
        return (f"it is an image-text model of a type megatrain-ray has not been checked on (covered: "
                f"{', '.join(COVERED)}); its vision tower's inputs and the way its forward merges image features "
                "differ from type to type, so it is refused rather than trained unchecked; train it with "
                "transformers' own Trainer")
    return None


def embed_inputs(mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What an image-text model's forward takes of a micro-batch: its token ids, the processor's
    image tensors and token types (never position_ids: the model makes its own)."""
    return {k: v for k, v in mb.items() if k not in NOT_INPUTS}


def is_pixels(key: str) -> bool:
    """Whether the model's input `key` is one that only its vision towers read."""
    return key in PIXEL_KEYS or key.endswith("pixel_values")


def vision_kwargs(inputs: dict[str, torch.Tensor], w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's inputs with its pixel values in the weights' dtype (the compute dtype)."""
    dtype = next(iter(w.values())).dtype
    return {k: v.to(dtype) if is_pixels(k) and v.is_floating_point() else v for k, v in inputs.items()}


def tower_shape(config: dict[str, Any]) -> tuple[int, int, int, int, float]:
    """An image-text config's vision tower: its width, its MLP's width, its layers, the pixel values
    of one patch, and its patches for each image token the language model reads (the merger's or
    pixel shuffle's square, else a SigLIP image's patches over its image tokens, else one)."""
    v = config["vision_config"]
    width = v.get("embed_dim") or v["hidden_size"]  # Qwen2-VL's hidden_size is its merger's output
    mlp = v.get("intermediate_size") or int(v.get("mlp_ratio", 4) * width)
    layers = v.get("depth") or v["num_hidden_layers"]
    channels = v.get("in_channels") or v.get("num_channels") or v.get("in_chans") or 3
    patch = v["patch_size"] if isinstance(v["patch_size"], list) else [v["patch_size"]] * 2  # InternViT's [h, w]
    pixels = channels * v.get("temporal_patch_size", 1) * math.prod(patch)
    merge = v.get("spatial_merge_size") or config.get("spatial_merge_size") or config.get("scale_factor") \
        or config.get("downsample_factor") or (config.get("downsample_ratio") and round(1 / config["downsample_ratio"]))
    if merge:
        per_token = float(merge * merge)
    elif config.get("mm_tokens_per_image"):
        per_token = (v["image_size"] // v["patch_size"]) ** 2 / config["mm_tokens_per_image"]
    else:
        per_token = 1.0
    return width, mlp, layers, pixels, per_token


def tower_bytes(config: dict[str, Any], tokens: int, dtype_bytes: int, trained: bool) -> int:
    """The vision tower and projector's device memory for a micro-batch of `tokens` positions, all
    image tokens at most: its pixel values (fp32 as the processor makes them, and their copy in the
    compute dtype), and its activations: the forward's peak, or with `trained` every layer's kept
    for backward (TOWER_FORWARD_PER_PATCH, TOWER_KEPT_PER_PATCH_LAYER)."""
    width, mlp, layers, pixels, per_token = tower_shape(config)
    patches = math.ceil(tokens * per_token)
    per_w, per_mlp = TOWER_KEPT_PER_PATCH_LAYER if trained else TOWER_FORWARD_PER_PATCH
    activations = (layers if trained else 1) * (per_w * width + per_mlp * mlp)
    return patches * (pixels * (4 + dtype_bytes) + activations * dtype_bytes)
