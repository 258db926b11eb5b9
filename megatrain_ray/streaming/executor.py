"""The streaming executor: layers flow through K device slots, layer-major, forward then back.

One optimizer step: every micro-batch passes through a layer while its weights sit in a slot;
forward keeps only each layer's input (streaming/activation_stash.py), backward recomputes the layer under
a local autograd graph, accumulates its weight gradient on the device across micro-batches and
sends it to the host once (streaming/gradient_sink.py). The last `keep_graphs` blocks, where the GPU has the
memory for them (planning/memory.py), run their forward under autograd and keep its graph, with a copy of
their weights: their backward neither recomputes (but for MLP chunks, which stay checkpointed) nor
reads their weights again. The prefetcher (streaming/prefetcher.py) keeps the next layers copying into free
slots; three streams (streaming/streams.py) are ordered by events. On the CPU the streams are no-ops and
copies are plain memcpys: the same scheduler, testable without a GPU. The model's arithmetic comes
from its family (models/family.py) and nothing else.

With several data-parallel workers (streaming/data_parallel.py) each runs this same step on its share of the
micro-batches; the loss is scaled by the step's global target count, each gradient is summed across
the workers before it leaves and leaves from its owner only, and the loss and norm are summed once.

The head's loss is the step plan's choice: the next-token cross-entropy, or the clipped
policy-ratio loss of reinforcement learning (`head_loss`, rl/loss.py), whose token log-probabilities
come chunk by chunk from the same head and whose per-token advantages, old and reference
log-probabilities and normalising weights ride in the micro-batches beside the labels.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from megatrain_ray.streaming.activation_stash import ActivationStash
from megatrain_ray.streaming.compiled import compile_head_loss, compiled_blocks
from megatrain_ray.streaming.data_parallel import Group
from megatrain_ray.streaming.gradient_sink import GradientSink
from megatrain_ray.streaming.hooks import NO_HOOKS, StepHooks
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.family import IGNORE_INDEX
from megatrain_ray.models.layout import EMBED, HEAD, LayerLayout, detached, shared_part
from megatrain_ray.models.ops import packs_documents
from megatrain_ray.models.registry import family, model_layouts
from megatrain_ray.rl.loss import PolicyLoss, PolicyMetrics, TokenLoss, label_logprobs, token_losses
from megatrain_ray.streaming.prefetcher import Prefetcher, Slot
from megatrain_ray.streaming.layer_order import Unit, kept_blocks, model_units, step_order
from megatrain_ray.streaming import rng
from megatrain_ray.host.sources import LayerSource
from megatrain_ray.streaming.step_result import EvalResult, StepResult
from megatrain_ray.streaming.streams import Streams, TransferStats


def pick_device(name: str, index: int | None = None) -> torch.device:
    """executor.device as a torch device; `index`: which of the visible GPUs (a data-parallel rank's)."""
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("executor.device is 'cuda' but no CUDA GPU is visible; set executor.device=cpu or auto")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name, index) if name == "cuda" and index is not None else torch.device(name)


def _to_device(batch: dict, device: torch.device) -> dict[str, torch.Tensor]:
    """Ray hands numpy arrays over read-only; batches are small, so copy them."""
    return {k: _tensor(v).to(device, non_blocking=True) for k, v in batch.items()}


def _tensor(v) -> torch.Tensor:
    return torch.from_numpy(np.array(v)) if isinstance(v, np.ndarray) else torch.as_tensor(v)


def target_tokens(batch: dict) -> int:
    """Tokens the loss counts in a micro-batch (numpy arrays or tensors)."""
    return int((batch["labels"] != IGNORE_INDEX).sum())


def _leaf(buffer: torch.Tensor) -> torch.Tensor:
    return buffer.detach().requires_grad_(True)


def merged(by_layer: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A unit's weights by layer as the one dict its block runs with."""
    return {name: t for w in by_layer.values() for name, t in w.items()}


class AuxLoss:
    """A family's auxiliary loss over one step (models/family.py, ModelFamily.aux_loss_on): forward sums
    each micro-batch's block statistics; each block's backward adds its share, weighted like the
    micro-batch's token loss: its target tokens over the step's (so one micro-batch of the step
    adds the auxiliary loss exactly as transformers does to its mean token loss)."""

    def __init__(self, mbs: list[dict], scale: float):
        self.weights = [target_tokens(mb) * scale for mb in mbs]
        self.totals: list[torch.Tensor | None] = [None] * len(mbs)
        self.value = 0.0

    def count(self, mb: int, stats: torch.Tensor | None) -> None:
        if stats is not None:
            self.totals[mb] = stats if self.totals[mb] is None else self.totals[mb] + stats

    def term(self, family, arch, mb: int, stats: torch.Tensor) -> torch.Tensor:
        term = family.aux_loss_term(arch, stats, self.totals[mb]) * self.weights[mb]
        self.value = self.value + term.detach()
        return term


@dataclass
class BlockGraph:
    """One micro-batch's pass through a block under autograd: what its backward differentiates."""

    x: torch.Tensor  # the input, a leaf
    w: dict[int, dict[str, torch.Tensor]]  # the weights by layer (the unit's own, then shared ones), one leaf each
    y: torch.Tensor
    stats: torch.Tensor | None  # the block's auxiliary statistics (models/family.py, ModelFamily.aux_loss_on)


class StreamingExecutor:
    def __init__(
        self,
        arch: ModelArch,
        source: LayerSource,
        device: torch.device,
        compute_dtype: torch.dtype,
        num_slots: int = 3,
        loss_chunk_tokens: int = 4096,
        compile_blocks: bool = False,
        mlp_chunk_tokens: int = 0,
        offload_activations: bool = False,
        group: Group | None = None,
        keep_graphs: int = 0,
        hooks: StepHooks = NO_HOOKS,
        head_loss: TokenLoss | PolicyLoss = TokenLoss(),
        host_gradients: tuple[int, ...] = (),
        train_vision: bool = False,
    ):
        self.arch = arch
        self.head_loss = head_loss  # the objective's (objective.py): the token cross-entropy or the policy loss
        self.source = source
        self.device = device
        self.dtype = compute_dtype
        self.loss_chunk_tokens = loss_chunk_tokens
        self.family = family(arch)
        # what trains (model.train_vision): the embedding's frozen tensors are detached (_embed)
        self.layouts: tuple[LayerLayout, ...] = model_layouts(arch, train_vision)
        self.units = model_units(arch)
        self.streams = Streams(device)
        self.stats = TransferStats()
        self.prefetcher = Prefetcher(self.layouts, source, self.streams, compute_dtype, num_slots, self.stats, hooks)
        self.mlp_chunk = mlp_chunk_tokens
        self.offload_activations = offload_activations
        self.kept = kept_blocks(self.units, keep_graphs)
        self.aux = self.family.aux_loss_on(arch)  # the block returns (y, stats) for an auxiliary loss
        # dropout: each recompute replays its forward's draws (streaming/rng.py); the step plan runs
        # such blocks eagerly (`compile_blocks` False), as torch.compile's forward and recompute
        # graphs need not draw alike
        self.replay = self.family.draws_random(arch)
        self.compiled_block = self.compiled_kept_block = self.compiled_head_loss = None
        self.metrics: PolicyMetrics | None = None
        if compile_blocks and self.streams.cuda:
            self.compiled_block, self.compiled_kept_block = compiled_blocks(self.family, arch)
            self.compiled_head_loss = compile_head_loss(self.family.head_loss)
        self.group = group or Group.solo(len(self.layouts))
        # `host_gradients`: the layers whose gradient the step plan sums in host memory (streaming/host_gradients.py)
        self.grads = GradientSink(self.layouts, source, self.streams, compute_dtype, self.stats, self.group, hooks,
                                  host_gradients)

    # -- layer order ----------------------------------------------------------------------------
    def _order(self) -> tuple[list[Unit], list[int]]:
        """Units in execution order and the flat order in which they need layers."""
        order = step_order(self.units, len(self.kept))
        return order, [layer for unit in order for layer in unit.layers]

    @contextlib.contextmanager
    def _computing(self):
        """Time one unit's compute: on CUDA between events recorded after its slot waits."""
        s = self.streams
        start, t0 = s.record(s.compute, timing=True), time.perf_counter()
        yield
        end, t1 = s.record(s.compute, timing=True), time.perf_counter()
        if s.cuda:
            self.stats.compute_events.append((start, end))
        else:
            self.stats.compute_seconds += t1 - t0
        if self.stats.first_compute is None:
            self.stats.first_compute = start if s.cuda else t0
        self.stats.last_compute = end if s.cuda else t1

    def _views(self, slot_or_leaf: torch.Tensor, layer: int) -> dict[str, torch.Tensor]:
        return self.layouts[layer].views(slot_or_leaf)

    def _unit_weights(self, unit: Unit, buffers: list[torch.Tensor],
                      bind: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> dict[int, dict[str, torch.Tensor]]:
        """An embedding's or a block's weights by layer, each tensor through `bind`: its own layer's,
        then the shared part of each layer whose block it runs too (LayerLayout.shares)."""
        own = {name: bind(view) for name, view in self._views(buffers[0], unit.layers[0]).items()}
        by_layer = {unit.layers[0]: own}
        for buffer, layer in zip(buffers[1:], unit.layers[1:]):
            by_layer[layer] = {name: bind(view) for name, view in shared_part(own, self._views(buffer, layer)).items()}
        return by_layer

    # -- one optimizer step --------------------------------------------------------------------
    def train_step(self, micro_batches: list[dict], make_update: Callable[[float], object] | None,
                   step_target_tokens: int | None = None) -> StepResult:
        """Forward and backward over all micro-batches, then (unless skipped) the layer updates.

        `make_update(grad_norm)` returns the AdamW hyper-parameters for this step; a step whose
        loss or gradient is not finite is skipped (the stores only restore their weights).
        `step_target_tokens`: the loss's denominator, the target tokens of the whole step, every
        worker's micro-batches (default: these micro-batches'; a worker alone has all of them).
        """
        t0 = time.perf_counter()
        if self.streams.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self.stats = self.prefetcher.stats = self.grads.stats = TransferStats()
        self.stats.step_start = self.streams.record(self.streams.compute, timing=True) if self.streams.cuda else t0
        order, layers = self._order()
        self.prefetcher.begin_step(layers)
        self.grads.begin_step()
        target = sum(target_tokens(mb) for mb in micro_batches)
        scale = 1.0 / max(1, target if step_target_tokens is None else step_target_tokens)
        mbs = [_to_device(mb, self.device) for mb in micro_batches]
        ctxs = self._contexts(micro_batches, mbs)
        self.metrics = PolicyMetrics(self.device) if self.head_loss.policy else None

        cursor = itertools.count()
        saved = ActivationStash(self.streams, self.offload_activations)
        graphs: dict[Unit, list[BlockGraph]] = {}
        aux = AuxLoss(micro_batches, scale) if self.aux else None
        draws: dict[tuple[int, int], rng.RngState] = {}  # (layer, micro-batch) -> its forward's generators
        x: list = [self.family.embed_inputs(self.arch, mb) for mb in mbs]
        for unit in self.units[:-1]:
            slots = [self.prefetcher.acquire(next(cursor)) for _ in unit.layers]
            with self._computing():
                if unit in self.kept:
                    graphs[unit] = self._forward_keeping(unit, slots, x, ctxs, aux)
                    x = [g.y.detach() for g in graphs[unit]]
                else:
                    with torch.no_grad():
                        weights = merged(self._unit_weights(unit, [slot.buffer for slot in slots]))
                        inputs, x = x, [self._forward(unit, weights, xi, ctx, aux, i, draws)
                                        for i, (xi, ctx) in enumerate(zip(x, ctxs))]
                    saved.push(inputs)
            for slot in slots:
                self.prefetcher.release(slot)

        head = self.units[-1]
        slots = [self.prefetcher.acquire(next(cursor)) for _ in head.layers]
        with self._computing():
            loss, dy = self._head_backward(head, slots, x, mbs, scale)
        for slot in slots:
            self.prefetcher.release(slot)
        self.grads.send(head.layers[0])
        del x

        for unit in reversed(self.units[:-1]):
            if unit in graphs:
                with self._computing():
                    dy = [self._differentiate(mb, g, dyi, aux)
                          for mb, (g, dyi) in enumerate(zip(graphs.pop(unit), dy))]
            else:
                slots = [self.prefetcher.acquire(next(cursor)) for _ in unit.layers]
                with self._computing():
                    dy = self._block_backward(unit, slots, saved.pop(), dy, ctxs, aux, draws)
                for slot in slots:
                    self.prefetcher.release(slot)
            self.grads.send(unit.layers[0])

        if aux is not None:
            loss = loss + aux.value
        loss_value, grad_norm = self._loss_and_norm(loss)  # the one sync of the step
        finite = math.isfinite(loss_value) and math.isfinite(grad_norm)
        hp = None
        if make_update is not None:
            hp = make_update(grad_norm) if finite else None  # None: skip, only restore the weights
            for layer in self._update_order():
                self.source.update(layer, hp, self.grads.landed.get(layer))
        result = self._result(t0, loss_value, grad_norm, finite, mbs, target)
        result.lr = getattr(hp, "lr", None)
        result.policy = self.metrics.as_dict() if self.metrics is not None else None
        return result

    def _update_order(self) -> list[int]:
        """The layers this worker updates, the host's in forward order (the next step's first layers
        are ready first), then those stepped on a device: a layer stepped on a device is updated by
        every worker (its owner steps it, the others receive its weights), and its launches would
        hold back this worker's messages. A store takes the messages of all workers as they come:
        sent from the same moment, they reach it about in forward order."""
        on_device = self.source.steps_on_device
        mine = [layout.index for layout in self.layouts if self.group.owns(layout.index) or on_device(layout.index)]
        return sorted(mine, key=on_device)

    # -- validation: forward only ----------------------------------------------------------------
    def eval_loss(self, micro_batches: list[dict]) -> EvalResult:
        """The summed token loss over the micro-batches, layer-major like a step's forward, without
        its backward: no input is kept for a recompute, no gradient is made or sent, no store is
        touched. Weights are read as the stores hold them (after any pending update has landed)."""
        t0 = time.perf_counter()
        total = torch.zeros((), dtype=torch.float32, device=self.device)

        def at_head(head_w, embed_w, x, mb):
            nonlocal total
            total += self.family.head_loss(self.arch, head_w, embed_w, x, mb["labels"], self.loss_chunk_tokens, 1.0)

        mbs = self._forward_only(micro_batches, at_head)
        loss_sum = float(total)  # the one sync
        return EvalResult(loss_sum, sum(target_tokens(mb) for mb in micro_batches),
                          sum(mb["input_ids"].numel() for mb in mbs), time.perf_counter() - t0)

    def token_logprobs(self, micro_batches: list[dict], source: LayerSource | None = None) -> list[np.ndarray]:
        """Each micro-batch's log-probability of every label under the weights the stores hold now
        (0 where the label is ignored), [rows x tokens] in fp32: a forward like `eval_loss`'s, the
        head's logits made a chunk at a time. The policy loss's old log-probabilities; with `source`
        (host/sources.py, FrozenSource), under its weights instead, through the same slots (a step
        starts with none resident): the reference's."""
        if source is not None:
            main, self.prefetcher.source = self.prefetcher.source, source
            try:
                return self.token_logprobs(micro_batches)
            finally:
                self.prefetcher.source = main
        out: list[torch.Tensor] = []

        def at_head(head_w, embed_w, x, mb):
            flat_x, labels = x.reshape(-1, x.shape[-1]), mb["labels"].reshape(-1)
            chunks = [label_logprobs(self.family.logits(self.arch, head_w, embed_w, flat_x[start:start + n]),
                                     labels[start:start + n])[0] for start in range(0, labels.numel(), n)]
            out.append(torch.cat(chunks).view(mb["labels"].shape))

        n = self.loss_chunk_tokens
        self._forward_only(micro_batches, at_head)
        return [lp.cpu().numpy() for lp in out]

    def _forward_only(self, micro_batches: list[dict], at_head: Callable) -> list[dict]:
        """The step's forward without autograd over every layer, evaluating (no dropout); the head
        hands each micro-batch's final hidden states to `at_head(head_w, embed_w, x, mb)`."""
        self.stats = self.prefetcher.stats = self.grads.stats = TransferStats()
        self.prefetcher.begin_step([layer for unit in self.units for layer in unit.layers])
        mbs = [_to_device(mb, self.device) for mb in micro_batches]
        ctxs = self._contexts(micro_batches, mbs)
        cursor = itertools.count()
        x: list = [self.family.embed_inputs(self.arch, mb) for mb in mbs]
        with torch.no_grad(), self.family.evaluating(self.arch):
            for unit in self.units:
                slots = [self.prefetcher.acquire(next(cursor)) for _ in unit.layers]
                with self._computing():
                    weights = [self._views(slot.buffer, layer) for slot, layer in zip(slots, unit.layers)]
                    if unit.kind == HEAD:
                        embed_w = weights[1] if len(weights) > 1 else None
                        for xi, mb in zip(x, mbs):
                            at_head(weights[0], embed_w, xi, mb)
                    else:
                        block_w = merged(self._unit_weights(unit, [slot.buffer for slot in slots]))
                        x = [self._forward(unit, block_w, xi, ctx) for xi, ctx in zip(x, ctxs)]
                for slot in slots:
                    self.prefetcher.release(slot)
        return mbs

    def _contexts(self, micro_batches: list[dict], mbs: list[dict]) -> list:
        """Each micro-batch's context, told from the host's copy whether a row packs documents."""
        return [self.family.batch_context(self.arch, mb, self.dtype, packs_documents(host["position_ids"]))
                for host, mb in zip(micro_batches, mbs)]

    def _loss_and_norm(self, loss: torch.Tensor) -> tuple[float, float]:
        """The step's loss and global gradient norm, summed over the workers in one collective
        (each worker's loss share; each owner's squared norm over the layers it owns)."""
        self.grads.finish()
        if self.group.world == 1:
            return float(loss), math.sqrt(float(self.grads.norm_sq))
        both = torch.stack([loss.to(torch.float32), self.grads.norm_sq])
        self.group.all_reduce(both)
        loss_value, norm_sq = both.tolist()
        return loss_value, math.sqrt(norm_sq)

    def _forward(self, unit: Unit, w: dict, x: torch.Tensor, ctx, aux: "AuxLoss | None" = None,
                 mb: int = 0, draws: dict | None = None) -> torch.Tensor:
        """A unit's forward; a block's auxiliary statistics go to `aux` (validation drops them);
        with `draws`, the generators' state before it, for its recompute to replay."""
        if draws is not None and self.replay:
            draws[(unit.layers[0], mb)] = rng.capture(self.device)
        if unit.kind == EMBED:
            return self._embed(w, x)
        y = self._block(w, x, self.family.layer_context(self.arch, ctx, unit.layers[0]))
        if self.aux:
            y, stats = y
            if aux is not None:
                aux.count(mb, stats)
        return y

    def _embed(self, w: dict, x):
        """The embedding's template, its frozen tensors (an image-text model's vision tower unless
        model.train_vision: LayerLayout.frozen_names) detached: no gradient reaches them."""
        return self.family.embed(self.arch, detached(w, self.layouts[0].frozen_names), x)

    def _bind_leaves(self, buffer: torch.Tensor, layer: int) -> dict[str, torch.Tensor]:
        """Each parameter a separate autograd leaf viewing the slot: gradients come back per
        parameter, with no full-layer zero-fill per view that a single flat leaf would cost."""
        return {name: _leaf(view) for name, view in self._views(buffer, layer).items()}

    def _block(self, w: dict, x: torch.Tensor, ctx, keeping: bool = False):
        """Compiled when the micro-batch is short enough to need no MLP chunking; `keeping`: for a
        graph kept until backward (streaming/compiled.py). With an auxiliary loss, (y, stats)
        (models/family.py, ModelFamily.aux_loss_on)."""
        kw = {"aux": True} if self.aux else {}
        if 0 < self.mlp_chunk < x.shape[0] * x.shape[1]:
            return self.family.block(self.arch, w, x, ctx, self.mlp_chunk, **kw)
        compiled = self.compiled_kept_block if keeping else self.compiled_block
        if compiled is not None:
            return compiled(self.arch, w, x, ctx, **kw)
        return self.family.block(self.arch, w, x, ctx, **kw)

    def _head_backward(self, unit: Unit, slots: list[Slot], xs, mbs, scale: float):
        """Forward and backward of final norm + LM head, one chunk of tokens at a time: each chunk
        is differentiated as soon as its loss exists, so its logits are made once (a checkpointed
        loss would make them again in backward) and live for that chunk only."""
        bound = [self._bind_leaves(slot.buffer, layer) for slot, layer in zip(slots, unit.layers)]
        head_w, embed_w = bound[0], (bound[1] if len(bound) > 1 else None)
        params = [t for w in bound for t in w.values()]
        head_loss = self.compiled_head_loss or self.family.head_loss
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)  # already the mean
        dxs = []
        for x, mb in zip(xs, mbs):
            flat_x, flat_labels = x.reshape(-1, x.shape[-1]), mb["labels"].reshape(-1)
            dx = torch.empty_like(flat_x)
            for start in range(0, flat_x.shape[0], self.loss_chunk_tokens):
                chunk = slice(start, start + self.loss_chunk_tokens)
                x_chunk = _leaf(flat_x[chunk])
                if self.head_loss.policy:
                    loss = self._policy_loss(head_w, embed_w, x_chunk, mb, chunk)
                else:
                    loss = head_loss(self.arch, head_w, embed_w, x_chunk, flat_labels[chunk], self.loss_chunk_tokens,
                                     1.0) * scale
                dx_chunk, *grads = torch.autograd.grad(loss, [x_chunk, *params], allow_unused=True,
                                                       materialize_grads=True)
                dx[chunk] = dx_chunk
                loss_sum += loss.detach()
                per_param = iter(grads)
                for layer, w in zip(unit.layers, bound):
                    self.grads.add(layer, {name: next(per_param) for name in w})
                del grads, per_param  # one chunk's weight gradient alive at a time
            dxs.append(dx.view(x.shape))
        return loss_sum, dxs

    def _policy_loss(self, head_w, embed_w, x_chunk: torch.Tensor, mb: dict, chunk: slice) -> torch.Tensor:
        """One chunk's share of the step's policy loss (rl/loss.py): its tokens' losses weighted by
        the step's normalisation (`loss_weights`, 0 off the completions). Without `old_logprobs`
        (one update per rollout) the old policy is this one: the ratio is 1, its gradient A."""
        take = lambda key: mb[key].reshape(-1)[chunk]  # noqa: E731
        labels = take("labels")
        logp, entropy = label_logprobs(self.family.logits(self.arch, head_w, embed_w, x_chunk), labels)
        old = take("old_logprobs") if "old_logprobs" in mb else logp.detach()
        ref = take("ref_logprobs") if "ref_logprobs" in mb else None
        losses = token_losses(logp, old, take("advantages"), ref, self.head_loss)
        self.metrics.add(labels != IGNORE_INDEX, losses, entropy)
        return (losses.loss * take("loss_weights")).sum()

    def _block_backward(self, unit: Unit, slots: list[Slot], inputs, dys, ctxs, aux: "AuxLoss | None", draws: dict):
        """Recompute each micro-batch's forward under a local graph (drawing the random numbers its
        forward drew), then backward through it."""
        dxs = []
        layer = unit.layers[0]
        for mb, (x, dy, ctx) in enumerate(zip(inputs, dys, ctxs)):
            with rng.replayed(draws.pop((layer, mb), None), self.device):
                if unit.kind == EMBED:
                    w = self._bind_leaves(slots[0].buffer, layer)
                    y = self._embed(w, x)
                    grads = torch.autograd.grad(y, list(w.values()), dy, allow_unused=True, materialize_grads=True)
                    self.grads.add(layer, dict(zip(w, grads)))
                    del grads  # one micro-batch's weight gradient alive at a time
                    dxs.append(None)
                else:
                    w = self._unit_weights(unit, [slot.buffer for slot in slots], _leaf)
                    dxs.append(self._differentiate(mb, self._graph(unit, w, x, ctx, aux), dy, aux))
        return dxs

    def _forward_keeping(self, unit: Unit, slots: list[Slot], xs, ctxs, aux: "AuxLoss | None") -> list[BlockGraph]:
        """A block's forward under autograd, its graph kept for backward. The graph reads a copy of
        the weights: the slot takes other layers before the backward comes back to this one."""
        weights = [slot.buffer.clone() for slot in slots]
        graphs = []
        for mb, (x, ctx) in enumerate(zip(xs, ctxs)):
            graphs.append(self._graph(unit, self._unit_weights(unit, weights, _leaf), x, ctx, aux, keeping=True))
            if aux is not None:
                aux.count(mb, None if graphs[-1].stats is None else graphs[-1].stats.detach())
        return graphs

    def _graph(self, unit: Unit, w: dict[int, dict], x: torch.Tensor, ctx, aux: "AuxLoss | None",
               keeping: bool = False) -> BlockGraph:
        """A block's forward under autograd from its input as a fresh leaf, on its weights by layer
        (a step's, with `aux`: its statistics join the graph)."""
        x = _leaf(x)
        y = self._block(merged(w), x, self.family.layer_context(self.arch, ctx, unit.layers[0]), keeping)
        stats = None
        if self.aux:
            y, stats = y
        return BlockGraph(x, w, y, stats if aux is not None else None)

    def _differentiate(self, mb: int, g: BlockGraph, dy: torch.Tensor, aux: "AuxLoss | None"):
        """Backward through one micro-batch's block graph: its weight gradient joins the accumulator
        of the layer each weight came from, the input's gradient is returned. A block's share of the
        auxiliary loss joins its output in what is differentiated."""
        outputs, out_grads = [g.y], [dy]
        if g.stats is not None:
            term = aux.term(self.family, self.arch, mb, g.stats)
            outputs.append(term)
            out_grads.append(torch.ones_like(term))
        # a tensor no output depends on (a router's bias that only picks experts) gets a zero gradient
        leaves = [t for w in g.w.values() for t in w.values()]
        dx, *grads = torch.autograd.grad(outputs, [g.x, *leaves], out_grads, allow_unused=True, materialize_grads=True)
        per_param = iter(grads)
        for layer, w in g.w.items():
            self.grads.add(layer, {name: next(per_param) for name in w})
        return dx

    def _result(self, t0, loss, grad_norm, finite, mbs, target) -> StepResult:
        st = self.stats
        if self.streams.cuda:
            self.streams.synchronize()
            h2d_s = sum(a.elapsed_time(b) for a, b in st.h2d_events) / 1e3
            d2h_s = sum(a.elapsed_time(b) for a, b in st.d2h_events) / 1e3
            peak = torch.cuda.max_memory_allocated(self.device)
            compute_s = sum(a.elapsed_time(b) for a, b in st.compute_events) / 1e3
        else:
            h2d_s, d2h_s, peak, compute_s = st.h2d_seconds, st.d2h_seconds, 0, st.compute_seconds
        seconds = time.perf_counter() - t0
        before, between, after = _waits(st, compute_s, seconds, self.streams.cuda)
        return StepResult(
            loss=loss,
            grad_norm=grad_norm,
            tokens=sum(mb["input_ids"].numel() for mb in mbs),
            target_tokens=target,
            finite=finite,
            seconds=seconds,
            h2d_bytes=st.h2d_bytes,
            d2h_bytes=st.d2h_bytes,
            h2d_gbps=st.h2d_bytes / h2d_s / 1e9 if h2d_s > 0 else 0.0,
            d2h_gbps=st.d2h_bytes / d2h_s / 1e9 if d2h_s > 0 else 0.0,
            prefetch_wait_s=st.prefetch_wait_s,
            compute_s=compute_s,
            weight_copies=st.copies,
            peak_device_bytes=peak,
            wait_before_s=before,
            wait_between_s=between,
            wait_after_s=after,
            host_add_wait_s=st.host_add_wait_s,
        )


def _waits(st: TransferStats, compute_s: float, seconds: float, cuda: bool) -> tuple[float, float, float]:
    """A step's time outside compute, split where it happened: before the first layer computed
    (the batch, the first weights), between layers (weights or updates not ready, launches), after
    the last (the norm's sync, sending the updates)."""
    if st.first_compute is None:
        return 0.0, 0.0, max(0.0, seconds - compute_s)
    if cuda:
        before = st.step_start.elapsed_time(st.first_compute) / 1e3
        span = st.step_start.elapsed_time(st.last_compute) / 1e3
    else:
        before, span = st.first_compute - st.step_start, st.last_compute - st.step_start
    return before, max(0.0, span - before - compute_s), max(0.0, seconds - span)
