"""An image-text model's own processor (its chat template, its image tokens, its resizing), from
the model's directory.

AutoProcessor builds it where it can. Where it cannot, for want of torchvision (a processor whose
constructor checks the class of its video processor, Qwen2.5-VL's, fails without it:
"VIDEO_PROCESSOR_MAPPING has no attribute '_extra_content'"; one named as its processor,
LLaVA-NeXT-Video's, recurses), it is composed from its parts as
AutoProcessor would compose them: the model's processor class over its image processor on the PIL
backend, its tokenizer and its processor_config.json, without a video processor (image-text rows
have no video).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatrain_ray.data.chat_template import ChatTemplate, special_tokens
from megatrain_ray.data.documents import DataError


def load_image_text_processor(tokenizer: str | None) -> tuple[Any, ChatTemplate]:
    """data.tokenizer's directory (the model's, by default) as the processor and the chat template
    of image-text rows."""
    if tokenizer is None:
        raise DataError("image-text rows need the model's processor: set data.tokenizer (or model.path) to the "
                        "model's directory")
    directory = Path(tokenizer).expanduser()
    directory = directory if directory.is_dir() else directory.parent
    config = directory / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    processor = load_processor(directory, model_type)
    text = getattr(processor, "chat_template", None)
    if not isinstance(text, str):
        raise DataError(f"the processor of {directory} has no chat template (chat_template.jinja or "
                        "chat_template.json); image-text rows are rendered with the model's own")
    return processor, ChatTemplate(str(directory), text, special_tokens(directory))


def load_processor(model_dir: str | Path, model_type: str | None):
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(str(model_dir))
    # no torchvision: compose it (a video processor whose name ends as its processor's, LLaVA-NeXT-Video's
    # LlavaNextVideoProcessor, is looked up as that processor again, without end)
    except (AttributeError, ImportError, ValueError, TypeError, OSError, RecursionError):
        if model_type is None:
            raise DataError(f"cannot load the processor of {model_dir}: AutoProcessor failed and its config.json "
                            "names no model_type") from None
    try:
        return composed_processor(str(model_dir), model_type)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"cannot load the processor of the image-text model in {model_dir} (its tokenizer, "
                        f"preprocessor_config.json and chat template): {type(e).__name__}: {e}") from None


def composed_processor(model_dir: str, model_type: str):
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    named = processor_class_named(model_dir)  # as AutoProcessor reads it (one of transformers'); else the type's own
    base = getattr(transformers, named, None) if named else None
    base = base or getattr(transformers, PROCESSOR_MAPPING_NAMES[model_type])
    cls = without_video_check(base)
    processor_dict, _ = cls.get_processor_dict(model_dir)
    parts = {"image_processor": AutoImageProcessor.from_pretrained(model_dir, backend="pil"),
             "tokenizer": AutoTokenizer.from_pretrained(model_dir)}
    args = [parts.get(name) for name in cls.get_attributes()]
    return cls.from_args_and_dict(args, processor_dict)


def processor_class_named(model_dir: str) -> str | None:
    """The processor class that the directory's processor_config.json names (GLM-OCR's, a type with
    no processor of its own, names GLM-4V's), None where it names none."""
    file = Path(model_dir) / "processor_config.json"
    if not file.is_file():
        return None
    named = json.loads(file.read_text()).get("processor_class")
    return named if isinstance(named, str) else None


def without_video_check(base: type) -> type:
    """The processor class, its constructor's class check passed over for a missing video processor
    (the check looks its expected class up among torchvision's, absent here); named as the class."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument is None and "video" in argument_name:
            return None
        return base.check_argument_for_proper_class(self, argument_name, argument)

    return type(base.__name__, (base,), {"check_argument_for_proper_class": check_argument_for_proper_class,
                                         "__module__": base.__module__})
