"""Load an image-text model directory (a run's export) with transformers, as any such model, and
answer a question about an image:

    python examples/generate_image_text.py MODEL_DIR IMAGE ["what colour is this"]

The ordinary transformers code: AutoProcessor (the model's chat template, image tokens, resizing)
and AutoModelForImageTextToText's greedy generate. Needs `transformers` and `pillow`; many
processors (Qwen2-VL's and others: README, Image-text fine-tuning) need torchvision to load too.
"""

import sys

from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor


def answer(model_dir: str, image: str, question: str, max_new_tokens: int = 8) -> str:
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=prompt, images=Image.open(image).convert("RGB"), return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return processor.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


if __name__ == "__main__":
    print(answer(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "what colour is this"))
