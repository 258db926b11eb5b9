"""The example scripts of examples/, loaded as modules: a test calls their functions in its own
process (which has torch and transformers imported already) instead of starting a Python for them."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example_module(name: str) -> ModuleType:
    """examples/<name>.py as a module (its `if __name__ == "__main__"` part not run)."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
