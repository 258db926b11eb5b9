"""Hugging Face Hub names (`Qwen/Qwen2.5-7B-Instruct`) for model.path and data.tokenizer.

A value that is not a local path but has a Hub repository id's `owner/name` shape is resolved
through huggingface_hub: the local cache first (HF_HOME, HF_HUB_CACHE), then, unless
HF_HUB_OFFLINE is set, a download of the files a run reads (config, safetensors, tokenizer, chat
template). Offline and not cached is a one-paragraph error that gives the command to download it.
As such a name may as well be a mistyped relative directory, every message about it says both:
no such directory here, and what the Hub said. Any other path that does not exist (`gpt2`,
`runs/a/model`) is a missing file, which the reader of that setting reports.

The resolved directory is a path on the driver's machine; stores on other nodes load the weights
from the same path, so on a multi-node cluster the cache must be shared storage (or downloaded on
every node), as for any model.path.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from megatrain_ray.config import Config, ConfigError

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")  # owner/name
MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]
TOKENIZER_FILES = ["tokenizer*", "*.jinja", "special_tokens_map.json", "config.json", "*.model", "*.txt"]


class HubError(ConfigError):
    """A Hub name that cannot be resolved; the message says what to run."""


def looks_like_hub_name(value: str) -> bool:
    """`owner/name`, and nothing on disk by that name; explicit paths (/, ./, ~) never are."""
    if value.startswith(("/", "./", "../", "~")) or Path(value).expanduser().exists():
        return False
    return REPO_ID.match(value) is not None and not value.endswith((".json", ".yaml", ".jinja"))


def offline() -> bool:
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE", "").strip().lower()
    return flag in ("1", "true", "yes", "on") or bool(constants.HF_HUB_OFFLINE)


def cache_dir() -> str | None:
    """The hub cache as the environment names it now (huggingface_hub reads it once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None


def download_hint(name: str) -> str:
    return f"`hf download {name}` (with an older huggingface_hub: `huggingface-cli download {name}`)"


def not_here(value: str) -> str:
    return f"there is no directory {value} here ({Path.cwd()})"


def resolve_hub_name(value: str, setting: str, patterns: list[str]) -> str:
    """A local directory for `value`: itself when local, else the cached (or downloaded) snapshot."""
    if not looks_like_hub_name(value):
        return value
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = cache_dir()
    try:
        return snapshot_download(value, allow_patterns=patterns, cache_dir=cache, local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    where = cache or "the default Hugging Face cache (~/.cache/huggingface/hub)"
    if offline():
        raise HubError(
            f"{setting} {value!r} is not a local path ({not_here(value)}), and as a Hugging Face Hub name it is not "
            f"in {where} while HF_HUB_OFFLINE is set: check the path, or download it on a machine with network "
            f"access with {download_hint(value)} (same HF_HOME), or set {setting} to a local directory"
        )
    print(f"{setting}: {not_here(value)}; downloading {value} as a Hugging Face Hub name into {where}", flush=True)
    try:
        return snapshot_download(value, allow_patterns=patterns, cache_dir=cache)
    except Exception as e:  # no network, no such repository, a gated one: huggingface_hub's own message
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HubError(
            f"{setting} {value!r} is not a local path ({not_here(value)}) and could not be fetched from the "
            f"Hugging Face Hub ({type(e).__name__}: {first}); check the path or the name, log in with `hf auth login` for a gated model, or "
            f"download it with {download_hint(value)}, or set {setting} to a local directory"
        ) from None


def resolve_names(config: Config) -> Config:
    """model.path and data.tokenizer as local paths (Hub names resolved); data.tokenizer defaults to
    the model's directory, where a Hugging Face model keeps its tokenizer."""
    model, data = config.model, config.data
    if model.path is not None:
        model = dataclasses.replace(model, path=resolve_hub_name(model.path, "model.path", MODEL_FILES))
    if data.tokenizer is not None:
        data = dataclasses.replace(data, tokenizer=resolve_hub_name(data.tokenizer, "data.tokenizer", TOKENIZER_FILES))
    elif model.path is not None and data.source != "synthetic":
        data = dataclasses.replace(data, tokenizer=model.path)
    return config.replace(model=model, data=data)
