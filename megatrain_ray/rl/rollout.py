"""The rollout: a copy of the policy that samples each prompt's completions.

The copy is transformers' own model of the family, built from the config.json the export writes
(models' `hf_config`) in grpo.rollout_dtype on the meta device, its tensors allocated on the
rollout's device only, and its weights loaded from the stores before every step's sampling (so it
is never more than the last update behind: none). It decodes a batch of sequences at once with a
KV cache, left-padded (rl/decoding.py: on a GPU each decode step one CUDA graph where the model
allows), sampling each token with temperature and top-p from its own generator,
whose state the checkpoints keep (`sampler_state`). It reads nothing of the run but the weights it
is handed and keeps no state but the generator: a Ray actor on a GPU of its own holds it
unchanged and samples while the first GPU trains, one policy version behind (grpo.rollout_gpu:
own; rl/step.py, GrpoStep.ahead). On a GPU its weights stay there, as the run plans the training step within what the copy
leaves (planning/gpu_share.py, from `rollout_bytes`); where they do not all fit, the decoder
layers the run did not keep resident stream through two slots at every forward
(rl/layer_stream.py). The decoding's memory (the KV cache, the sampler's tensors) goes back after
each sampling (`free_cache`): moving 15 GB of weights each way each step would cost seconds and
buy nothing.
"""

from __future__ import annotations

import base64
import time
import warnings
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch

from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.layout import BLOCK
from megatrain_ray.models.registry import arch_to_hf_config, model_layouts, num_params
from megatrain_ray.rl.decoding import PREFILL_TOKENS, decoding_for, static_applies
from megatrain_ray.rl.layer_stream import LayerStream
from megatrain_ray.rl.loss import label_logprobs


def hf_model(arch: ModelArch, dtype: torch.dtype, device: torch.device, streamed: tuple[str, ...] = ()):
    """transformers' causal LM for `arch`, from the config.json the export writes, in `dtype`,
    evaluating, its parameters allocated on `device` but for those under the `streamed` prefixes
    (left on the meta device for rl/layer_stream.py) and their values not set (`Rollout.load` sets
    them): built on the meta device, so no host copy of the whole model is ever made."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(arch_to_hf_config(arch, torch_dtype=str(dtype).removeprefix("torch.")))
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval().requires_grad_(False)
    for name, param in list(model.named_parameters()):
        if not name.startswith(streamed):
            set_tensor(model, name, torch.nn.Parameter(torch.empty_like(param, device=device), requires_grad=False))
    for module in model.modules():  # buffers (RoPE's frequencies): made again by transformers' own init
        for name, buffer in list(module.named_buffers(recurse=False)):
            module.register_buffer(name, torch.empty_like(buffer, device=device),
                                   persistent=name not in module._non_persistent_buffers_set)
        if module._buffers:
            model._init_weights(module)
    model.tie_weights()
    return model


def set_tensor(model: torch.nn.Module, name: str, value: torch.nn.Parameter) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner), leaf, value)


GiB = 1024**3


def rollout_device(name: str) -> torch.device:
    """grpo.rollout_device as a torch device (auto: a GPU where this process sees one)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def rollout_bytes(arch: ModelArch, rows: int, seq_len: int, dtype_bytes: int, resident_layers: int | None = None) -> int:
    """The device memory the rollout takes while it samples `rows` sequences of up to `seq_len`
    tokens: its copy's weights (with `resident_layers` of the decoder layers, None: all, and two
    slots for the others: rl/layer_stream.py), every row's KV cache at full length, the sampler's
    fp32 probabilities (a few copies of [rows x vocab]), the prompts' forward (`prefill_bytes`)
    and 1 GiB for what else the process holds (its CUDA context, cuBLAS's workspace)."""
    blocks = [layout.numel for layout in model_layouts(arch) if layout.kind == BLOCK]
    resident = len(blocks) if resident_layers is None else min(resident_layers, len(blocks))
    streamed = blocks[resident:]
    weights = (num_params(arch) - sum(streamed) + (2 * max(streamed) if streamed else 0)) * dtype_bytes
    kv_cache = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * dtype_bytes * rows * seq_len
    sampler = 4 * rows * arch.vocab_size * 4
    return weights + kv_cache + sampler + prefill_bytes(arch, rows, seq_len, dtype_bytes) + GiB


def prefill_bytes(arch: ModelArch, rows: int, seq_len: int, dtype_bytes: int) -> int:
    """A decoder layer's activations in the prompts' forward: the hidden states' few copies and the
    MLP's three intermediate tensors, over one chunk of `PREFILL_TOKENS`; and the chunk's attention
    mask over the whole sequence (rl/decoding.py: the additive 4D mask and the two bool ones it is
    made from)."""
    tokens = min(rows * seq_len, max(rows, PREFILL_TOKENS))
    return tokens * ((6 * arch.hidden_size + 3 * arch.intermediate_size) * dtype_bytes + seq_len * (dtype_bytes + 2))


def num_decoder_layers(arch: ModelArch) -> int:
    return sum(layout.kind == BLOCK for layout in model_layouts(arch))


def resident_layers_within(arch: ModelArch, rows: int, seq_len: int, dtype_bytes: int, budget: int) -> int | None:
    """The most decoder layers the rollout can keep on its device within `budget` bytes (all of
    them: None), the others streamed; -1 where even none leaves room for the KV cache."""
    if rollout_bytes(arch, rows, seq_len, dtype_bytes) <= budget:
        return None
    fits = [k for k in range(num_decoder_layers(arch)) if rollout_bytes(arch, rows, seq_len, dtype_bytes, k) <= budget]
    return max(fits, default=-1)


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row from softmax(logits / temperature), within the smallest set of tokens
    whose probability reaches top_p (the most likely token always in it): the token where the row's
    cumulative probability passes its `uniform` number (in [0, 1)) of its total. A row's token
    depends on its own logits and number alone, so rows split over several rollouts draw what one
    rollout of them all would."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # the mass of the tokens more likely than each
        sorted_probs = sorted_probs * (before < top_p)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    cumulative = probs.cumsum(dim=-1)
    token = torch.searchsorted(cumulative, (uniform.float() * cumulative[:, -1])[:, None], right=True).squeeze(-1)
    last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)  # the last token of nonzero probability
    return torch.minimum(token, last)


def prompt_parts(prompts: int, copies: int) -> list[tuple[int, int]]:
    """Each rollout copy's prompts (start, end) of a step's `prompts`, in order, as even as they go
    (the first ones one more): a prompt's group stays on one copy."""
    size, more = divmod(prompts, copies)
    ends = np.cumsum([size + (i < more) for i in range(copies)]).tolist()
    return list(zip([0] + ends[:-1], ends))


@dataclass(frozen=True)
class CopyTiming:
    """One rollout copy's sampling of its share of a step: when it started and ended (the node's
    clock, time.time(): the copies of one node compare), the completion tokens it sampled, the
    prompts' forward's seconds, the decode steps after it and the CPU seconds of the thread that
    ran them (the Python loop that launches the kernels); so a log shows whether several copies
    sampled side by side, what a decode step took on each, and whether the host's CPU bound it (a
    CPU share near 1: each step waits for its kernels' launches, not for the GPU)."""

    start: float
    end: float
    tokens: int
    prefill_seconds: float
    decode_steps: int
    cpu_seconds: float

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def cpu_share(self) -> float:
        return self.cpu_seconds / self.seconds if self.seconds > 0 else 0.0

    @property
    def ms_per_decode_step(self) -> float:
        return 1000 * (self.seconds - self.prefill_seconds) / max(1, self.decode_steps)

    def to_dict(self) -> dict:
        return {"start": self.start, "end": self.end, "tokens": self.tokens, "prefill_seconds": self.prefill_seconds,
                "decode_steps": self.decode_steps, "cpu_seconds": self.cpu_seconds}


def overlap(copies: list[CopyTiming]) -> float:
    """The share of the longest copy's sampling during which every copy sampled (1: side by side
    throughout; 0 or less: one after another)."""
    longest = max(c.seconds for c in copies)
    return (min(c.end for c in copies) - max(c.start for c in copies)) / longest if longest > 0 else 1.0


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    eos_id: int | None = None  # a completion ends after its first EOS (which it keeps); None: at max_new_tokens


class Rollout:
    def __init__(self, arch: ModelArch, dtype: torch.dtype, device: torch.device, seed: int,
                 resident_layers: int | None = None, graphs: bool = True):
        """`resident_layers`: the decoder layers whose weights stay on `device` (None: all); the
        others stream through it at every forward (rl/layer_stream.py), the first ones resident.
        `graphs`: a decode step on a GPU is a CUDA graph where it can be (rl/decoding.py)."""
        self.arch, self.dtype, self.device = arch, dtype, device
        self.layouts = model_layouts(arch)
        blocks = [layout for layout in self.layouts if layout.kind == BLOCK]
        streamed = blocks[resident_layers:] if resident_layers is not None else []
        self.model = hf_model(arch, dtype, device, tuple(layout.prefix for layout in streamed))
        self.stream = LayerStream(self.model, blocks[0].prefix.rstrip("."), streamed, dtype, device) if streamed else None
        self.generator = torch.Generator(device).manual_seed(seed)
        self.prefill_tokens = PREFILL_TOKENS
        self.graphs = graphs
        self.side_stream = None  # the CUDA graphs' (rl/decoding.py), made at the first sampling that captures one

    def streamed_layers(self) -> list[int]:
        """The layers (by layout index) whose weights stream through the device at every forward."""
        return [layout.index for layout in self.stream.layouts] if self.stream is not None else []

    def describe(self) -> str:
        where = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        parts = [f"{self.device} ({where}), {str(self.dtype).removeprefix('torch.')}"]
        if self.stream is not None:
            blocks, streamed = num_decoder_layers(self.arch), len(self.stream.layouts)
            parts.append(f"{blocks - streamed} of {blocks} decoder layers resident, {streamed} streamed from host "
                         f"memory at every decode step ({self.stream.bytes_per_forward() / GiB:.1f} GiB host to device a step)")
        return "; ".join(parts + [self.describe_decoding()])

    def describe_decoding(self) -> str:
        if not static_applies(self.model.config):
            return "its KV cache grows a token at a time"
        return "its KV cache at the full length" + (", each decode step one CUDA graph" if self.captures() else "")

    def captures(self) -> bool:
        """Whether a decode step is to be a CUDA graph: on a GPU, every layer resident, no capture refused."""
        return self.graphs and self.stream is None and self.device.type == "cuda"

    # -- weights -------------------------------------------------------------------------------
    def refresh(self, policy) -> None:
        """The weights of `policy` (rl/step.py, Policy) as it holds them now."""
        self.load(policy.rollout_weights())

    def load(self, layer_weights: Iterable[tuple[int, torch.Tensor]]) -> None:
        """The policy's weights from (layer, flat weights: the stores' compute copy or the fp32
        master) pairs, one layer at a time, into the copy on the rollout's device; a streamed
        layer's are read from host memory at each forward (rl/layer_stream.py, `hold`: in place
        where they are page-locked in the rollout's dtype, so the caller hands tensors that hold
        still until the next load)."""
        params = dict(self.model.named_parameters())
        seen = set()
        with torch.no_grad():
            for layer, flat in layer_weights:
                layout = self.layouts[layer]
                if self.stream is not None and self.stream.streams(layer):
                    self.stream.hold(layer, flat)
                    seen.update(layout.hf_name(slot.name) for slot in layout.params)
                    continue
                for name, view in layout.views(flat).items():
                    hf_name = layout.hf_name(name)
                    params[hf_name].copy_(view.reshape(params[hf_name].shape))
                    seen.add(hf_name)
        missing = [n for n, p in params.items() if n not in seen and not self._tied(n)]
        if missing:
            raise RuntimeError(f"the rollout's copy got no weights for {missing[:3]}: the layouts and transformers' "
                               f"model of {self.arch.model_type} name them differently")

    def _tied(self, name: str) -> bool:
        return name == "lm_head.weight" and getattr(self.model.config, "tie_word_embeddings", False)

    def free_cache(self) -> None:
        """The decoding's memory back to the device (the trainer is another process: the allocator's
        cache is emptied); the weights stay."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- sampling -------------------------------------------------------------------------------
    def sample(self, prompts: list[np.ndarray], group_size: int, s: Sampling) -> tuple[list[np.ndarray], float]:
        """`group_size` completions of every prompt, prompt by prompt (completion i of the result
        follows prompt i // group_size), decoded as one batch; and the seconds it took."""
        completions, _, (timing,) = self.sample_scored(prompts, group_size, s, scored=False)
        return completions, timing.seconds

    def sample_scored(self, prompts: list[np.ndarray], group_size: int, s: Sampling, scored: bool = True,
                      part: tuple[int, int] | None = None
                      ) -> tuple[list[np.ndarray], list[np.ndarray] | None, list[CopyTiming]]:
        """As `sample`, with each completion token's log-probability under the copy (fp32, of its
        logits untempered: the policy's, as the loss takes it); None where not `scored`; and the
        copy's timing (one: this copy's; runtime/grpo_steps.py joins several copies' lists). `part`: (the first
        prompt's place, the step's prompts) where `prompts` are this copy's share of a step's
        (`prompt_parts`); None: all of them."""
        start, cpu = time.time(), time.thread_time()
        first, total = part or (0, len(prompts))
        try:
            completions, logprobs, prefill_s, steps = self._decode([p for p in prompts for _ in range(group_size)], s,
                                                                   scored, (first * group_size, total * group_size))
        finally:
            self.free_cache()  # after the decoding's tensors are gone
        return completions, logprobs, [CopyTiming(start, time.time(), sum(len(c) for c in completions), prefill_s,
                                                  steps, time.thread_time() - cpu)]

    def start_sampling(self, prompts: list[np.ndarray], group_size: int, s: Sampling):
        """`sample_scored` for a step that waits for it later: in process there is nothing to overlap,
        so it samples now (the rollout's actor samples while the caller goes on: runtime/grpo_steps.py, RemoteRollout)."""
        result = self.sample_scored(prompts, group_size, s)
        return lambda: result

    @torch.no_grad()
    def _decode(self, rows: list[np.ndarray], s: Sampling, scored: bool,
                place: tuple[int, int]) -> tuple[list[np.ndarray], list[np.ndarray] | None, float, int]:
        """`place`: (the first row's place, the step's rows): every copy draws the step's numbers,
        one a row and token, and takes its rows' (`sample_tokens`). Also the seconds until the
        prompts' forward's logits were made and the decode steps (forwards) after it."""
        t0 = time.perf_counter()
        first, total = place
        uniforms = torch.rand(total, s.max_new_tokens, generator=self.generator,
                              device=self.generator.device)[first:first + len(rows)].to(self.device)
        ids, mask, positions = left_padded(rows, self.device)
        decoding = self.decoding(mask, s.max_new_tokens)
        try:
            logits = decoding.prefill(ids, positions)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # once a sampling: the prompts' forward's seconds
            prefill_s = time.perf_counter() - t0
            done = torch.zeros(len(rows), dtype=torch.bool, device=self.device)
            new, scores = [], []
            for k in range(s.max_new_tokens):
                token = sample_tokens(logits, s.temperature, s.top_p, uniforms[:, k])
                new.append(torch.where(done, torch.zeros_like(token), token))
                if scored:
                    scores.append(torch.log_softmax(logits.float(), dim=-1).gather(-1, token[:, None]).squeeze(-1))
                if len(new) == s.max_new_tokens:
                    break
                if s.eos_id is not None:
                    done |= token == s.eos_id
                    if bool(done.all()):
                        break
                logits = decoding.step(new[-1])
        finally:
            decoding.close()
        self.note_graph_failure(decoding.graph_failure)
        completions = [completion(row, s.eos_id) for row in torch.stack(new, dim=1).cpu().numpy()]
        if not scored:
            return completions, None, prefill_s, len(new) - 1
        logprobs = torch.stack(scores, dim=1).cpu().numpy()
        return completions, [row[:len(c)] for row, c in zip(logprobs, completions)], prefill_s, len(new) - 1

    def decoding(self, mask: torch.Tensor, max_new_tokens: int):
        """This copy's forwards for one sampling (rl/decoding.py): static where the model allows, its
        decode step a CUDA graph where every weight is resident on a GPU and capturing has not failed."""
        if not self.captures():
            return decoding_for(self.model, mask, max_new_tokens, None, self.prefill_tokens)
        self.side_stream = self.side_stream or torch.cuda.Stream(self.device)
        return decoding_for(self.model, mask, max_new_tokens, self.side_stream, self.prefill_tokens)

    def note_graph_failure(self, failure: str | None) -> None:
        """A decode step that could not be captured: said once, and the copy decodes eagerly from then on."""
        if failure is not None and self.graphs:
            self.graphs = False
            warnings.warn(f"megatrain-ray: the rollout's decode step of {self.arch.model_type} could not be captured as "
                          f"a CUDA graph ({failure}); it runs eagerly, one kernel launch at a time")

    # -- log-probabilities ----------------------------------------------------------------------
    @torch.no_grad()
    def policy_logprobs(self, micro_batches: list[dict]) -> list[np.ndarray]:
        """The log-probability of every label of the micro-batches (0 where ignored) under the
        rollout's copy of the policy, as last loaded."""
        try:
            return label_logprobs_of(self.model, micro_batches, self.device)
        finally:
            self.free_cache()

    # -- the sampler's state, for the checkpoints -----------------------------------------------
    def sampler_state(self) -> str:
        return base64.b64encode(self.generator.get_state().numpy().tobytes()).decode()

    def set_sampler_state(self, state: str) -> None:
        self.generator.set_state(torch.frombuffer(bytearray(base64.b64decode(state)), dtype=torch.uint8))


@torch.no_grad()
def label_logprobs_of(model, micro_batches: list[dict], device: torch.device) -> list[np.ndarray]:
    """Each label's log-probability under a transformers model (0 where ignored), a micro-batch at a time."""
    out = []
    for mb in micro_batches:
        ids, positions = (torch.tensor(mb[k]).to(device) for k in ("input_ids", "position_ids"))
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        out.append(label_logprobs(logits, torch.tensor(mb["labels"]).to(device))[0].cpu().numpy())
    return out


def left_padded(rows: list[np.ndarray], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, attention mask and positions of the rows, left-padded: every row's next token
    is the batch's next column."""
    width = max(len(p) for p in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, p in enumerate(rows):
        ids[i, width - len(p):] = torch.tensor(p)  # a copy: Ray hands arrays over read-only
        mask[i, width - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), positions.to(device)


def completion(row: np.ndarray, eos_id: int | None) -> np.ndarray:
    """A sampled row up to and with its first EOS."""
    if eos_id is not None:
        ends = np.flatnonzero(row == eos_id)
        if len(ends):
            return row[:ends[0] + 1].astype(np.int64)
    return row.astype(np.int64)
