"""Every setting as a frozen dataclass; YAML files plus `--set section.key=value` overrides.

Unknown keys and wrong types are refused with one clear message (naming the nearest valid key),
and values of the right type that cannot work (a zero chunk, negative sizes, betas outside [0, 1))
all together in one message, before anything heavy starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

OBJECT_STORE_MINIMUM = 75 * 1024**2  # bytes: Ray refuses a smaller object store


class ConfigError(ValueError):
    """A configuration the user must fix; the message says how."""


@dataclass(frozen=True)
class ModelConfig:
    preset: str | None = None  # a named model shape, random init (models.registry.PRESETS; README, Models)
    path: str | None = None  # a Hugging Face model directory (config.json + safetensors)
    compute_dtype: str = "bfloat16"  # bfloat16 | float32: the copy the executor streams
    init_std: float = 0.02  # random initialisation when no path is given
    overrides: dict[str, Any] = field(default_factory=dict)  # ModelArch fields to change, e.g. num_layers
    router_aux_loss_coef: float | None = None  # MoE load-balancing loss; None: as config.json says, 0: off
    implementation: str = "auto"  # auto | native | transformers: a hand-written family, or transformers' own modules (auto: hand-written where one exists)
    train_vision: bool = False  # an image-text model's vision tower and projector train too (default: frozen)


@dataclass(frozen=True)
class DataConfig:
    source: str = "synthetic"  # synthetic | a file, directory or glob of parquet/arrow/jsonl
    format: str = "auto"  # auto (from the columns: input_ids tokens, conversations or messages sharegpt (with images: sharegpt_images), instruction + output alpaca, text_column text) | tokens | text | alpaca | sharegpt | sharegpt_images
    tokenizer: str | None = None  # tokenizer.json (or its directory, or a Hub name) for text and SFT; default: model.path
    chat_template: str = "auto"  # SFT: auto (the model's, else fallback) | model | fallback (### User:/### Assistant:) | a .jinja file
    text_column: str = "text"  # column holding the text of format text
    seq_len: int = 128  # tokens per row (sequence length)
    pack: bool = True  # several documents per row, each attending only to itself
    truncate: bool = True  # longer documents: split (text, tokens) or cut (SFT) to seq_len; false: refused
    shuffle: bool = True  # permute file order per epoch and shuffle documents in a buffer
    add_eos: bool = True  # end each text document with the tokenizer's EOS
    eos_token_id: int | None = None  # overrides the EOS found in the tokenizer ("</s>", "<|endoftext|>", ...)
    shuffle_buffer: int = 1024  # documents held for the streaming shuffle (bounds memory)
    read_batch_rows: int = 256  # rows read (and tokenized) at a time from a file
    synthetic_docs: int = 4096  # documents per epoch of the synthetic source
    bad_rows: str = "skip"  # skip | stop: a row that cannot be trained on (malformed JSON, a missing column, ...) is skipped and counted by reason, or stops the run (with a checkpoint)
    max_bad_fraction: float = 0.01  # skip: the run stops (with a checkpoint) once more than this fraction of the rows read are bad (of at least 100 rows)


@dataclass(frozen=True)
class EvalConfig:
    source: str | None = None  # validation data (file, directory or glob), read like data.source
    holdout_fraction: float = 0.0  # else: this fraction of the training rows, held out of training
    every: int = 0  # steps between validations (and always after the last step); 0 = only after the last
    batches: int = 8  # micro-batches of train.micro_batch_size rows: the same ones every time


@dataclass(frozen=True)
class MetricsConfig:
    tensorboard: bool = False  # event files under <output_dir>/tensorboard (pip install 'megatrain-ray[tensorboard]')
    wandb: bool = False  # Weights & Biases (pip install 'megatrain-ray[wandb]'); WANDB_MODE=offline works
    wandb_project: str = "megatrain-ray"  # Weights & Biases project
    run_name: str | None = None  # default: the output directory's name


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-4  # peak learning rate
    min_lr_ratio: float = 0.1  # the cosine schedule decays to lr x this at its end, and stays there
    warmup_steps: int = 0  # linear warmup steps before the cosine decay
    schedule_steps: int | None = None  # the warmup + cosine schedule's length; None: train.steps, and on --resume the length the checkpoint's run trained with
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW's beta1, beta2
    eps: float = 1e-8  # AdamW's epsilon
    weight_decay: float = 0.1  # AdamW's decoupled weight decay
    grad_clip: float = 1.0  # max global gradient norm; 0 turns clipping off
    master: str = "fp32"  # fp32 | bf16: master weights; bf16 is updated with stochastic rounding and is the compute copy
    moments: str = "fp32"  # fp32 | bf16 | int8: AdamW's two moments (int8: a scale per block of 256); with name muon: the momentum's dtype too (fp32 | bf16)
    name: str = "adamw"  # adamw | muon: muon steps every matrix of the decoder blocks with torch.optim.Muon's update (3-D stacked experts: each expert's matrix), its one momentum buffer in host memory; the embedding, the head, norms, biases and 1-D tensors take AdamW with the settings above
    muon_lr: float | None = None  # Muon's peak learning rate (the same warmup and cosine schedule as optim.lr); null: optim.lr
    muon_weight_decay: float | None = None  # Muon's decoupled weight decay; null: optim.weight_decay
    muon_momentum: float = 0.95  # Muon's momentum
    muon_nesterov: bool = True  # Muon's Nesterov momentum
    muon_ns_steps: int = 5  # Newton-Schulz iterations (coefficients 3.4445, -4.775, 2.0315, in bf16, as torch.optim.Muon)
    muon_adjust_lr: str = "original"  # original: lr x sqrt(max(1, rows/cols)) | match_rms_adamw: lr x 0.2 sqrt(max(rows, cols)), which lets Muon reuse AdamW's lr and weight decay


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 10  # optimizer steps of the run (the LR schedule's length, unless optim.schedule_steps)
    micro_batch_size: int = 1  # rows per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step, all streamed layer-major
    seed: int = 0  # data order and random initialisation
    output_dir: str = "runs/default"  # metrics.jsonl, train.log, checkpoints/ and tensorboard/ go here
    max_bad_steps: int = 3  # non-finite loss or gradients in a row before the run stops
    auto_resume: bool | None = None  # after a lost node: wait for room, restore the last checkpoint; None = on under `ray job submit`
    resume_wait_s: float = 600.0  # how long auto-resume waits for the cluster to have room again
    max_restarts: int = 3  # auto-resumes per run before giving up
    step_timeout_s: float = 1800.0  # a step (or checkpoint) that takes longer stops the run; 0 = no limit
    objective: str = "lm"  # lm: next-token loss on data.source | grpo: reinforcement learning with verifiable rewards on the prompts of data.source (the grpo section)


@dataclass(frozen=True)
class GrpoConfig:
    group_size: int = 8  # completions sampled per prompt (G); the advantages are normalised within each group
    prompts_per_step: int = 4  # prompts per step: a step trains on prompts_per_step x group_size completions, train.micro_batch_size rows at a time
    max_new_tokens: int = 256  # tokens sampled per completion at most (it ends earlier at the EOS); a prompt may take data.seq_len less this
    temperature: float = 1.0  # sampling temperature
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens holding this much probability
    rewards: dict[str, float] = field(default_factory=lambda: {"exact_answer": 1.0})  # reward -> weight: exact_answer, math_answer (math-verify), format, or module:function
    answer_column: str = "answer"  # the column the exact_answer and math_answer rewards compare with
    format_pattern: str = r"(?s)^.*<answer>.+</answer>\s*$"  # the format reward: 1 where the completion matches this regex (re.fullmatch)
    loss_normalizer: str = "sequence"  # sequence (GRPO: mean over completions of their mean token loss) | token (DAPO: over every token of the step) | constant (Dr. GRPO: over completions x max_new_tokens)
    scale_rewards: bool = True  # advantages over the group's std; false: Dr. GRPO's unscaled advantages
    clip_low: float = 0.2  # the policy ratio is clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2  # DAPO's clip-higher: 0.28
    kl_coef: float = 0.0  # weight of the KL to the reference, model.path (k3 estimator), whose weights the GPU worker keeps once in host memory and streams; 0: none kept
    updates_per_rollout: int = 1  # optimizer updates on each step's completions (more than 1: the old policy's log-probabilities are computed and the ratio clips)
    rollout_dtype: str = "bfloat16"  # bfloat16 | float32: the rollout's copy of the policy
    rollout_device: str = "auto"  # auto | cuda | cpu: where the rollout copy samples
    rollout_gpu: str = "shared"  # shared: the rollout samples on the workers' GPUs between the updates (grpo.rollout_gpus) | own: on a GPU of its own (without GPUs: a process of its own), sampling the next step's completions while this step trains, one policy version behind (the rollout's log-probabilities are the old policy's)
    rollout_gpus: int | None = None  # copies of the policy that sample a step's prompts, each its share of them (the same completions as one copy, the arithmetic allowing): shared: on that many of the workers' GPUs | own: on that many GPUs of their own; without GPUs: processes; null: shared on every worker's GPU, own on one
    rollout_resident_layers: int | None = None  # decoder layers of the rollout copy kept on its device; the others stream from host memory through it at every decode step (slower: README); null: all where they fit beside the KV cache and the training step, else as many as fit


@dataclass(frozen=True)
class ExecutorConfig:
    device: str = "auto"  # auto | cuda | cpu
    num_slots: int | None = None  # weight slots per layer size on the device (prefetch depth + 1); null: 3, or 2 where the GPU memory needs it (the plan's choice)
    loss_chunk_tokens: int | None = None  # tokens per chunk of the LM-head loss; null: 4096, or fewer where the GPU memory needs it (the plan's choice)
    compile: bool = True  # torch.compile the decoder block on CUDA (fuses norms, RoPE, SwiGLU: ~20% faster)
    offload_activations: str = "auto"  # auto | on | off: park boundary activations in host memory (long contexts)
    mlp_chunk_tokens: int | None = None  # longer micro-batches run the MLP in checkpointed chunks of this many tokens; 0 = never; null: 16384, or fewer where the GPU memory needs it (the plan's choice)
    gpu_memory_gib: float | None = None  # GPU memory the run may use on each GPU (the plan fits the step under it and the worker's allocator is held to it; binds on CUDA only); null: what the GPU has free
    keep_graphs: int | None = None  # last blocks keeping their forward's graph (no recompute); None: as many as fit the GPU, 0 on a CPU
    embedding_step: str = "auto"  # auto | device | host: where the embedding's AdamW step runs (streaming/device_step.py); auto: the GPU, where the worker that owns its gradient reaches its store's memory and the GPU has room for it
    host_gradients: bool | None = None  # sum the embedding's and an untied LM head's weight gradients in pinned host memory, one micro-batch's or loss chunk's share on the device at a time (one GPU worker; streaming/host_gradients.py); null: only where the step does not fit the GPU otherwise (the plan's choice)


@dataclass(frozen=True)
class RuntimeConfig:
    address: str | None = None  # Ray address; None joins RAY_ADDRESS or a running cluster, else starts one; local: starts one
    num_cpus: int | None = None  # for an embedded Ray
    object_store_memory: int | None = None  # bytes, for an embedded Ray
    store_on_gpu_node: bool = True  # the GPU node holds a store too; false: only RAM nodes hold the model
    ram_resource: str = "megatrain_ram"  # the Ray resource that marks a RAM node
    shm_dir: str = "/dev/shm"  # tmpfs for the stores' shared buffers on the GPU node
    optimizer_threads: int | None = None  # per store; default: the CPUs Ray counts on its node less one and one per GPU worker there (a RAM node: less one)
    remote_window: int = 0  # pinned slots per layer size on the GPU node for layers on other nodes; 0 = from the plan
    transport_streams: int = 8  # TCP connections per store and direction; each layer is split over them (8: 0.956 of the local path at 7B, 4: 0.944)
    transport_piece_mib: float = 64.0  # the step's first layer, on another node, travels in pieces of this size: its store updates each piece of its gradient as it lands and sends it back at once; 0 = whole
    network_gbps: float = 25.0  # link speed the plan assumes for each node (it cannot measure it), Gbit/s
    num_gpus: int | None = None  # GPU workers, data parallel; None: every GPU of the GPU node (1 on a node without GPUs)
    worker_threads: int | None = None  # CPU threads of each GPU worker; default: the node's cores / the workers
    store_memory_gib: float | None = None  # host memory a store may take on its node; None: the node's MemAvailable at start
    disk_dir: str | None = None  # a directory on a local SSD for the disk tier: the optimizer state (AdamW moments; an fp32 master too) of the layers RAM cannot hold lives in files there, streamed in and out around each update, and where RAM is still short some layers' compute copy too; null: none


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0  # steps between checkpoints; 0 = only at the end
    keep: int = 2  # checkpoints kept; older ones are deleted once a new one is complete
    dir: str | None = None  # default: <output_dir>/checkpoints
    transport: str = "shared"  # shared: stores write to dir (shared storage); driver: stores send shards to the driver
    export_hf: bool = True  # write the final weights as a Hugging Face directory in the last checkpoint's hf/
    export_dtype: str = "float32"  # float32 | bfloat16: dtype of that export


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)

    def replace(self, **sections: Any) -> "Config":
        return dataclasses.replace(self, **sections)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def nearest_hint(name: str, options: list[str]) -> str:
    """"; did you mean 'x'?" for a misspelled key, else the list of valid keys."""
    match = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f"; did you mean {match[0]!r}?" if match else f"; valid keys: {', '.join(options)}"


def _coerce(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if hint is Any:
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{where} must be a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(v, a, where) for v, a in zip(value, args))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        return dict(value)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # PyYAML reads 1e-8 (no dot) as a string, following YAML 1.1
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where} must be a string, got {value!r}")
    raise ConfigError(f"{where}: unsupported setting type {hint}")


def _build(cls: type, values: dict[str, Any], where: str) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"{where or 'the config'} must be a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls)]
    kwargs = {}
    for key, value in values.items():
        path = f"{where}.{key}" if where else key
        if key not in names:
            raise ConfigError(f"unknown config key {path!r}{nearest_hint(key, names)}")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = _build(hint, value or {}, path)
        else:
            kwargs[key] = _coerce(value, hint, path)
    return cls(**kwargs)


def from_mapping(cls: type, values: dict[str, Any], where: str) -> Any:
    """Any frozen dataclass from a mapping, with the config's checks (unknown keys, types)."""
    return _build(cls, values, where)


class _Yaml12Loader(yaml.SafeLoader):
    """YAML 1.2 booleans (true/false only). PyYAML follows YAML 1.1, which also reads on/off/yes/no
    as booleans, so `offload_activations: off` arrived as False and was refused."""


_BOOL_TAG = "tag:yaml.org,2002:bool"
_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Yaml12Loader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def load_yaml(text: str) -> Any:
    """The one YAML reader of configs, --set values and cluster files."""
    return yaml.load(text, Loader=_Yaml12Loader)


def _parse_scalar(text: str) -> Any:
    return load_yaml(text) if text != "" else ""


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`section.key=value` strings (YAML values) applied onto a raw config dict."""
    raw = dict(raw)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set expects section.key=value, got {item!r}")
        dotted, text = item.split("=", 1)
        keys = dotted.strip().split(".")
        node = raw
        for key in keys[:-1]:
            node[key] = dict(node.get(key) or {})
            node = node[key]
        node[keys[-1]] = _parse_scalar(text)
    return raw


def config_from_dict(raw: dict[str, Any]) -> Config:
    config = _build(Config, raw or {}, "")
    check_values(config)
    return config


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A YAML config as a raw mapping, not yet validated (overrides may still change it)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    try:
        raw = load_yaml(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(raw).__name__}")
    return raw


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    raw = read_config_file(path) if path is not None else {}
    return config_from_dict(apply_overrides(raw, overrides or []))


def _finite(x: float) -> bool:
    return math.isfinite(x)


DATA_FORMATS = ("auto", "tokens", "text", "alpaca", "sharegpt", "sharegpt_images")  # data.format's values


def check_values(config: Config) -> None:
    """Every value of the right type that cannot work, refused here, before anything starts: all
    the problems of a config in one message, not one per run."""
    m, d, o, t, ex, rt, ck = (config.model, config.data, config.optim, config.train, config.executor,
                              config.runtime, config.checkpoint)
    ev, mt, g = config.eval, config.metrics, config.grpo
    checks = [
        (m.compute_dtype in ("bfloat16", "float32"), "model.compute_dtype must be bfloat16 or float32"),
        (m.implementation in ("auto", "native", "transformers"), "model.implementation must be auto, native or transformers"),
        (m.preset is not None or m.path is not None, "set model.preset or model.path"),
        (_finite(m.init_std) and m.init_std >= 0, "model.init_std must be a finite number >= 0"),
        (m.router_aux_loss_coef is None or (_finite(m.router_aux_loss_coef) and m.router_aux_loss_coef >= 0),
         "model.router_aux_loss_coef must be a finite number >= 0 (0: off)"),
        (d.format in DATA_FORMATS, f"data.format must be {', '.join(DATA_FORMATS[:-1])} or {DATA_FORMATS[-1]}"),
        (d.source != "", "data.source must be 'synthetic' or a file, directory or glob"),
        (d.text_column != "", "data.text_column must name a column"),
        (d.chat_template != "", "data.chat_template must be auto, model, fallback or a .jinja file"),
        (d.seq_len >= 2, "data.seq_len must be >= 2"),
        (d.eos_token_id is None or d.eos_token_id >= 0, "data.eos_token_id must be >= 0 (or null: from the tokenizer)"),
        (d.shuffle_buffer >= 1, "data.shuffle_buffer must be >= 1"),
        (d.read_batch_rows >= 1, "data.read_batch_rows must be >= 1"),
        (d.synthetic_docs >= 1, "data.synthetic_docs must be >= 1"),
        (d.bad_rows in ("skip", "stop"), "data.bad_rows must be skip or stop"),
        (0 <= d.max_bad_fraction <= 1, "data.max_bad_fraction must be within [0, 1]"),
        (0 <= ev.holdout_fraction < 1, "eval.holdout_fraction must be within [0, 1)"),
        (ev.source is None or ev.holdout_fraction == 0, "set eval.source or eval.holdout_fraction, not both"),
        (ev.source != "", "eval.source must be a file, directory or glob (or null)"),
        (ev.every >= 0, "eval.every must be >= 0 (0: only after the last step)"),
        (ev.batches >= 1, "eval.batches must be >= 1"),
        (mt.wandb_project != "", "metrics.wandb_project must name a project"),
        (mt.run_name != "", "metrics.run_name must be a name (or null: the output directory's)"),
        (_finite(o.lr) and o.lr >= 0, "optim.lr must be a finite number >= 0"),
        (0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio must be within [0, 1]"),
        (o.warmup_steps >= 0, "optim.warmup_steps must be >= 0"),
        (o.schedule_steps is None or o.schedule_steps >= 1, "optim.schedule_steps must be >= 1 (or null: train.steps)"),
        (all(0 <= b < 1 for b in o.betas), "optim.betas must both be within [0, 1)"),
        (_finite(o.eps) and o.eps > 0, "optim.eps must be a finite number > 0"),
        (_finite(o.weight_decay) and o.weight_decay >= 0, "optim.weight_decay must be a finite number >= 0"),
        (_finite(o.grad_clip) and o.grad_clip >= 0, "optim.grad_clip must be a finite number >= 0 (0: no clipping)"),
        (o.master in ("fp32", "bf16"), "optim.master must be fp32 or bf16"),
        (o.moments in ("fp32", "bf16", "int8"), "optim.moments must be fp32, bf16 or int8"),
        (o.name in ("adamw", "muon"), "optim.name must be adamw or muon"),
        (o.muon_lr is None or (_finite(o.muon_lr) and o.muon_lr >= 0), "optim.muon_lr must be a finite number >= 0 (or null: optim.lr)"),
        (o.muon_weight_decay is None or (_finite(o.muon_weight_decay) and o.muon_weight_decay >= 0),
         "optim.muon_weight_decay must be a finite number >= 0 (or null: optim.weight_decay)"),
        (0 <= o.muon_momentum < 1, "optim.muon_momentum must be within [0, 1)"),
        (1 <= o.muon_ns_steps < 100, "optim.muon_ns_steps must be within [1, 100)"),
        (o.muon_adjust_lr in ("original", "match_rms_adamw"), "optim.muon_adjust_lr must be original or match_rms_adamw"),
        (o.name != "muon" or o.moments in ("fp32", "bf16"),
         "optim.name=muon holds one momentum buffer in fp32 or bf16: set optim.moments to fp32 or bf16 (int8 is AdamW's)"),
        (o.master != "bf16" or m.compute_dtype == "bfloat16",
         "optim.master=bf16 is itself the compute copy: it needs model.compute_dtype=bfloat16"),
        ((o.master, o.moments) == ("fp32", "fp32") or ex.embedding_step != "device",
         "executor.embedding_step=device steps the embedding's fp32 optimizer state on the GPU; with lean state "
         "(optim.master/optim.moments) every layer steps on the host: set executor.embedding_step to auto or host"),
        (t.steps >= 0, "train.steps must be >= 0"),
        (t.micro_batch_size >= 1, "train.micro_batch_size must be >= 1"),
        (t.grad_accum >= 1, "train.grad_accum must be >= 1"),
        (0 <= t.seed < 2**32, "train.seed must be within [0, 2**32)"),
        (t.output_dir != "", "train.output_dir must be a directory"),
        (t.max_bad_steps >= 1, "train.max_bad_steps must be >= 1"),
        (t.resume_wait_s >= 0, "train.resume_wait_s must be >= 0"),
        (t.max_restarts >= 0, "train.max_restarts must be >= 0"),
        (t.step_timeout_s >= 0, "train.step_timeout_s must be >= 0 (0: no limit)"),
        (t.objective in ("lm", "grpo"), "train.objective must be lm or grpo"),
        (g.group_size >= 2, "grpo.group_size must be >= 2 (the advantages compare a prompt's completions)"),
        (g.prompts_per_step >= 1, "grpo.prompts_per_step must be >= 1"),
        (g.max_new_tokens >= 1, "grpo.max_new_tokens must be >= 1"),
        (_finite(g.temperature) and g.temperature > 0, "grpo.temperature must be a finite number > 0"),
        (0 < g.top_p <= 1, "grpo.top_p must be within (0, 1]"),
        (len(g.rewards) >= 1 and all(isinstance(w, (int, float)) and _finite(w) for w in g.rewards.values()),
         "grpo.rewards must map at least one reward (exact_answer, math_answer, format or module:function) to a "
         "finite weight"),
        (g.loss_normalizer in ("sequence", "token", "constant"), "grpo.loss_normalizer must be sequence, token or constant"),
        (0 <= g.clip_low < 1 and _finite(g.clip_high) and g.clip_high >= 0,
         "grpo.clip_low must be within [0, 1) and grpo.clip_high >= 0"),
        (_finite(g.kl_coef) and g.kl_coef >= 0, "grpo.kl_coef must be a finite number >= 0 (0: no reference)"),
        (g.updates_per_rollout >= 1, "grpo.updates_per_rollout must be >= 1"),
        (g.rollout_dtype in ("bfloat16", "float32"), "grpo.rollout_dtype must be bfloat16 or float32"),
        (g.rollout_device in ("auto", "cuda", "cpu"), "grpo.rollout_device must be auto, cuda or cpu"),
        (g.rollout_resident_layers is None or g.rollout_resident_layers >= 0,
         "grpo.rollout_resident_layers must be >= 0 (or null: as many as fit)"),
        (g.rollout_gpu in ("shared", "own"), "grpo.rollout_gpu must be shared or own"),
        (g.rollout_gpus is None or 1 <= g.rollout_gpus <= g.prompts_per_step,
         "grpo.rollout_gpus must be within 1 and grpo.prompts_per_step (each copy samples whole prompts' groups), or "
         "null: the plan chooses"),
        (g.rollout_gpu == "shared" or g.rollout_resident_layers is None,
         "grpo.rollout_gpu=own keeps every layer of the rollout's copy on its GPU (the updates rewrite the weights "
         "a streamed layer would read while it samples): unset grpo.rollout_resident_layers"),
        (ex.device in ("auto", "cuda", "cpu"), "executor.device must be auto, cuda or cpu"),
        (ex.num_slots is None or ex.num_slots >= 2,
         "executor.num_slots must be >= 2 (one computing, one prefetching), or null: the plan chooses"),
        (ex.loss_chunk_tokens is None or ex.loss_chunk_tokens >= 1,
         "executor.loss_chunk_tokens must be >= 1 (or null: the plan chooses)"),
        (ex.offload_activations in ("auto", "on", "off"), "executor.offload_activations must be auto, on or off"),
        (ex.embedding_step in ("auto", "device", "host"), "executor.embedding_step must be auto, device or host"),
        (ex.mlp_chunk_tokens is None or ex.mlp_chunk_tokens >= 0,
         "executor.mlp_chunk_tokens must be >= 0 (0: never chunk), or null: the plan chooses"),
        (ex.gpu_memory_gib is None or (_finite(ex.gpu_memory_gib) and ex.gpu_memory_gib > 0),
         "executor.gpu_memory_gib must be a finite number > 0 (or null: what the GPU has free)"),
        (ex.keep_graphs is None or ex.keep_graphs >= 0,
         "executor.keep_graphs must be >= 0 (0: every block recomputes its forward), or null: as many as fit"),
        (rt.address != "", "runtime.address must be a Ray address (or null)"),
        (rt.num_cpus is None or rt.num_cpus >= 1, "runtime.num_cpus must be >= 1 (or null: all cores)"),
        (rt.object_store_memory is None or rt.object_store_memory >= OBJECT_STORE_MINIMUM,
         f"runtime.object_store_memory must be >= {OBJECT_STORE_MINIMUM} bytes (Ray's minimum, 75 MiB), or null"),
        (rt.ram_resource != "", "runtime.ram_resource must name a Ray resource"),
        (rt.shm_dir != "", "runtime.shm_dir must be a directory (a tmpfs such as /dev/shm)"),
        (rt.optimizer_threads is None or rt.optimizer_threads >= 1,
         "runtime.optimizer_threads must be >= 1 (or null: the node's cores less one and one per GPU worker)"),
        (rt.num_gpus is None or rt.num_gpus >= 1, "runtime.num_gpus must be >= 1 (or null: every GPU of the GPU node)"),
        (rt.worker_threads is None or rt.worker_threads >= 1, "runtime.worker_threads must be >= 1 (or null)"),
        (rt.store_memory_gib is None or (_finite(rt.store_memory_gib) and rt.store_memory_gib > 0),
         "runtime.store_memory_gib must be a finite number > 0 (or null: the node's available memory)"),
        (rt.disk_dir is None or rt.disk_dir != "", "runtime.disk_dir must be a directory (or null: no disk tier)"),
        (rt.disk_dir is None or config.optim.name == "adamw",
         "runtime.disk_dir holds AdamW's moments: the disk tier does not yet hold Muon's momentum; set optim.name=adamw "
         "or runtime.disk_dir=null"),
        (rt.remote_window == 0 or rt.remote_window >= (ex.num_slots or 3),
         "runtime.remote_window must be 0 (the plan chooses) or at least executor.num_slots (3 when null)"),
        (rt.transport_streams >= 1, "runtime.transport_streams must be >= 1"),
        (_finite(rt.transport_piece_mib) and rt.transport_piece_mib >= 0,
         "runtime.transport_piece_mib must be a finite number >= 0 (0: whole layers)"),
        (_finite(rt.network_gbps) and rt.network_gbps > 0, "runtime.network_gbps must be a finite number > 0"),
        (ck.every >= 0, "checkpoint.every must be >= 0 (0: only at the end)"),
        (ck.keep >= 1, "checkpoint.keep must be >= 1"),
        (ck.dir != "", "checkpoint.dir must be a directory (or null: <train.output_dir>/checkpoints)"),
        (ck.transport in ("shared", "driver"), "checkpoint.transport must be shared or driver"),
        (ck.export_dtype in ("float32", "bfloat16"), "checkpoint.export_dtype must be float32 or bfloat16"),
    ]
    problems = [message for ok, message in checks if not ok]
    if problems:
        raise ConfigError("; ".join(problems))


def check_divisible(grad_accum: int, num_gpus: int) -> None:
    """Every GPU worker takes grad_accum / num_gpus micro-batches: equal shares, so that no GPU waits
    for another at each layer's gradient reduction."""
    if grad_accum % num_gpus:
        lower, upper = grad_accum - grad_accum % num_gpus, grad_accum + num_gpus - grad_accum % num_gpus
        raise ConfigError(
            f"train.grad_accum={grad_accum} micro-batches cannot be split evenly over {num_gpus} GPU workers "
            f"(runtime.num_gpus): each takes an equal share. Use a multiple of {num_gpus} "
            f"({', '.join(str(v) for v in (lower, upper) if v > 0)}), or another runtime.num_gpus")
