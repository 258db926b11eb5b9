"""Image-text models (AutoModelForImageTextToText) through transformers' own modules: what their
micro-batches carry and which of them train.

The language decoder streams as any decoder of the transformers family (models/generic.py). The
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
(models/generic.py, deepstack_features).
"""

from __future__ import annotations

from typing import Any

import torch

# the micro-batch's keys that are not the model's inputs
NOT_INPUTS = ("labels", "position_ids")
# the model's inputs that only its vision tower reads (the rest make the positions and masks)
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
}


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


def vision_kwargs(inputs: dict[str, torch.Tensor], w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's inputs with its pixel values in the weights' dtype (the compute dtype)."""
    dtype = next(iter(w.values())).dtype
    return {k: v.to(dtype) if k in PIXEL_KEYS and v.is_floating_point() else v for k, v in inputs.items()}
