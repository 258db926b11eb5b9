"""Where a run's metrics go besides metrics.jsonl: TensorBoard event files, Weights & Biases.

Both are optional extras, off unless configured (`metrics.tensorboard`, `metrics.wandb`), and
checked before the cluster starts: a missing package is a ConfigError with the pip command.
TensorBoard writes under `<output_dir>/tensorboard`; W&B under `<output_dir>/wandb`, online or
offline as its own settings say (`WANDB_MODE=offline`, `wandb login`). Each step's line of
metrics.jsonl becomes scalars under `train/...`, the validation loss `eval/loss`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from megatrain_ray.config import ConfigError, MetricsConfig

# metrics.jsonl keys -> tracker tags
SCALARS = {
    "loss": "train/loss",
    "grad_norm": "train/grad_norm",
    "lr": "train/lr",
    "tokens_per_s": "train/tokens_per_s",
    "seconds": "train/step_seconds",
    "h2d_gbps": "train/h2d_gbps",
    "eval_loss": "eval/loss",
}


class Tracker(Protocol):
    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def scalars_of(record: dict[str, Any]) -> dict[str, float]:
    """The tracked numbers of one metrics.jsonl record, under their tags."""
    return {tag: float(record[key]) for key, tag in SCALARS.items() if isinstance(record.get(key), (int, float))}


class TensorBoardTracker:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, cfg: MetricsConfig, out: Path, run_config: dict[str, Any]):
        import wandb

        self.run = wandb.init(project=cfg.wandb_project, name=cfg.run_name or out.resolve().name, dir=str(out),
                              config=run_config)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


EXTRAS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


def check_trackers(cfg: MetricsConfig) -> None:
    """Refuse a tracker whose package is missing, before anything starts."""
    import importlib.util

    for setting, (module, extra) in EXTRAS.items():
        if getattr(cfg, setting) and importlib.util.find_spec(module) is None:
            raise ConfigError(f"metrics.{setting}: true needs the {module} package: "
                              f"pip install 'megatrain-ray[{extra}]' (or set metrics.{setting}: false)")


def open_trackers(cfg: MetricsConfig, out: Path, run_config: dict[str, Any]) -> list[Tracker]:
    """The trackers metrics.* asks for (their packages were checked when the run started: check_trackers)."""
    trackers: list[Tracker] = []
    if cfg.tensorboard:
        trackers.append(TensorBoardTracker(out / "tensorboard"))
    if cfg.wandb:
        trackers.append(WandbTracker(cfg, out, run_config))
    return trackers
