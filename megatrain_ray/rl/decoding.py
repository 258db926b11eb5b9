"""A rollout copy's forwards over a batch of left-padded rows with a KV cache: the prompts' forward,
a few columns of every row at a time, then one token a row a step.

Two ways, the same arithmetic up to the order of a sum's terms:
- `StaticDecoding`, where every layer of the model attends to all of the sequence before it
  (transformers' StaticCache makes a plain full-attention layer for each: `static_applies`). The
  KV cache is allocated once at the sampling's full length and the attention mask is an additive
  4D mask of the rows' padding and the slots written so far, so a decode step's tensors keep their
  shapes and addresses from one step to the next. On a GPU, with every weight resident, the step
  is captured as a CUDA graph at the sampling's first step and replayed for the others: one launch
  a step instead of transformers' eager forward's one a kernel (1,324 a step at the Qwen2.5-7B
  shape), whose launches bound the step (examples/benchmarks/rollout-decode.py).
- `DynamicDecoding` elsewhere (sliding windows, linear attention, other caches): transformers'
  DynamicCache, which grows a step at a time, and transformers' own masks.

A forward that cannot be captured (one that waits on the GPU to choose its path, as a mixture of
experts' routing may) runs eagerly on the same static cache: `StaticDecoding.graph_failure` says why.
"""

from __future__ import annotations

import torch

# The prompts' forward runs on at most this many tokens at once (rows x a few columns of every
# row's prompt, the KV cache filling as it goes), so its activations stay small whatever the batch
# (at the Qwen2.5-32B shape one forward over 128 prompts of 256 tokens would hold 7 GB).
PREFILL_TOKENS = 8192


def forward_keywords(model) -> tuple[str, dict, bool]:
    """The name transformers' forward gives its KV cache (it renamed past_key_values to cache), the
    keyword that keeps the prompts' forward's logits to the last position where it has one, and
    whether it takes the slots a forward writes (`cache_position`: before 5.17 a static cache
    wrote where it said, else from the first slot)."""
    import inspect

    forward = inspect.signature(type(model).forward).parameters
    cache_kw = "cache" if "cache" in forward else "past_key_values"
    return cache_kw, ({"logits_to_keep": 1} if "logits_to_keep" in forward else {}), "cache_position" in forward


# The families whose forward reads a 4D attention mask as the mask alone (not the padding from
# which it makes ALiBi's biases or the positions, as BLOOM's and OPT's do), each held to
# transformers' forward without a cache by tests/rl/test_decoding.py.
STATIC_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "olmo2", "granite", "smollm3", "cohere",
                      "arcee", "glm4", "olmo", "stablelm", "starcoder2")


def static_applies(config) -> bool:
    """Whether a transformers model of `config` is of a family that `StaticDecoding` serves and
    every one of its layers keeps a plain full-attention KV cache (no sliding window), so that one
    additive mask serves all of them."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    if config.model_type not in STATIC_MODEL_TYPES:
        return False
    try:
        cache = StaticCache(config=config, max_cache_len=2)
    except Exception:  # a cache transformers cannot make static for this family
        return False
    return bool(cache.layers) and all(type(layer) is StaticLayer for layer in cache.layers)


def decoding_for(model, mask: torch.Tensor, max_new_tokens: int, side_stream: torch.cuda.Stream | None,
                 prefill_tokens: int = PREFILL_TOKENS):
    """The decoding of `model` for left-padded rows of attention `mask` [rows x prompt width] and
    up to `max_new_tokens` more: static where it applies (with a `side_stream` on a GPU, its decode
    step replayed as a CUDA graph captured there), else dynamic."""
    if static_applies(model.config):
        return StaticDecoding(model, mask, max_new_tokens, side_stream, prefill_tokens)
    return DynamicDecoding(model, mask, prefill_tokens)


def prefill_chunks(ids: torch.Tensor, prefill_tokens: int) -> list[tuple[int, int]]:
    """The prompts' forward's column ranges: every row's next few columns, `prefill_tokens` at most."""
    columns = max(1, prefill_tokens // len(ids))
    return [(start, min(start + columns, ids.shape[1])) for start in range(0, ids.shape[1], columns)]


class DynamicDecoding:
    """transformers' DynamicCache and masks from the 2D attention mask, grown a column a step."""

    graph_failure = None

    def __init__(self, model, mask: torch.Tensor, prefill_tokens: int = PREFILL_TOKENS):
        from transformers import DynamicCache

        self.model, self.mask, self.prefill_tokens = model, mask, prefill_tokens
        self.cache_kw, self.last_only, _ = forward_keywords(model)
        self.cache = DynamicCache(config=model.config)
        self.position = None

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The prompts' forward into the cache; each row's next-token logits."""
        for start, end in prefill_chunks(ids, self.prefill_tokens):
            logits = self.model(input_ids=ids[:, start:end], attention_mask=self.mask[:, :end],
                                position_ids=positions[:, start:end], use_cache=True,
                                **{self.cache_kw: self.cache}, **self.last_only).logits[:, -1]
        self.position = positions[:, -1:]
        return logits

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """The forward of each row's `token`; each row's next-token logits."""
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        self.position = self.position + 1
        return self.model(input_ids=token[:, None], attention_mask=self.mask, position_ids=self.position,
                          use_cache=True, **{self.cache_kw: self.cache}).logits[:, -1]

    def close(self) -> None:
        self.cache = None


class StaticDecoding:
    """transformers' StaticCache at the full length and an additive 4D mask made here; the decode
    step a CUDA graph where it can be. The graph is warmed up and captured on `side_stream`, the
    same one every sampling: cuBLAS keeps a workspace for each stream it runs on (32 MiB on an
    H200) for the process's life."""

    def __init__(self, model, mask: torch.Tensor, max_new_tokens: int, side_stream: torch.cuda.Stream | None,
                 prefill_tokens: int = PREFILL_TOKENS):
        from transformers import StaticCache

        self.model, self.prefill_tokens = model, prefill_tokens
        self.cache_kw, self.last_only, self.takes_slots = forward_keywords(model)
        device = mask.device
        rows, width = mask.shape
        length = width + max_new_tokens
        self.cache = StaticCache(config=model.config, max_cache_len=length)
        self.dtype = next(model.parameters()).dtype
        # the keys that are tokens, not left padding; every slot after the prompt is a token
        self.tokens = torch.cat([mask.bool(), mask.new_ones(rows, max_new_tokens, dtype=torch.bool)], dim=1)
        self.slots = torch.arange(length, device=device)
        # what a decode step reads: each row's last token and position and the slot it writes
        self.token = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.position = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.slot = torch.full((1,), width, dtype=torch.long, device=device)
        self.side_stream = side_stream if device.type == "cuda" else None
        self.capture = self.side_stream is not None
        self.graph, self.graph_logits, self.graph_failure = None, None, None

    def additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """[rows x queries x keys] of what may attend to what as the 4D mask transformers adds to the
        scores (the dtype's lowest where not: -inf would make a row of no keys NaN)."""
        lowest = torch.finfo(self.dtype).min
        return torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device).masked_fill_(~allowed, lowest)[:, None]

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The prompts' forward into the cache (column i writes slot i); each row's next-token
        logits. A query sees the tokens up to its own slot and always itself (a padding column's
        query sees no token: its row of the mask is not all masked, so it stays finite)."""
        for start, end in prefill_chunks(ids, self.prefill_tokens):
            queries = self.slots[start:end, None]
            allowed = (self.tokens[:, None, :] & (self.slots <= queries)) | (self.slots == queries)
            logits = self.model(input_ids=ids[:, start:end], attention_mask=self.additive(allowed),
                                position_ids=positions[:, start:end], use_cache=True, **self.last_only,
                                **self.cache_keywords(self.slots[start:end])).logits[:, -1]
        self.position.copy_(positions[:, -1:])
        return logits

    def cache_keywords(self, slots: torch.Tensor) -> dict:
        return {self.cache_kw: self.cache, **({"cache_position": slots} if self.takes_slots else {})}

    def forward_step(self) -> torch.Tensor:
        """One decode forward from the step's buffers, which it then moves on a slot: what the
        graph captures."""
        self.position.add_(1)
        allowed = (self.tokens & (self.slots <= self.slot))[:, None, :]
        logits = self.model(input_ids=self.token, attention_mask=self.additive(allowed), position_ids=self.position,
                            use_cache=True, **self.cache_keywords(self.slot)).logits[:, -1]
        self.slot.add_(1)
        return logits

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """The forward of each row's `token`; each row's next-token logits (on a GPU, the graph's
        output: read it before the next step)."""
        self.token.copy_(token[:, None])
        if self.graph is not None:
            self.graph.replay()
            return self.graph_logits
        if not self.capture:
            return self.forward_step()
        self.capture = False
        logits = self.warm_up()
        self.graph_logits, self.graph, self.graph_failure = self.captured()
        return logits

    def warm_up(self) -> torch.Tensor:
        """The first decode step, eagerly on a side stream (as CUDA graphs ask: what a capture may not
        do, as cuBLAS's first use of a stream, happens here)."""
        side, main = self.side_stream, torch.cuda.current_stream(self.slot.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            logits = self.forward_step()
        main.wait_stream(side)
        logits.record_stream(main)  # made on the side stream, read on this one
        return logits

    def captured(self) -> tuple[torch.Tensor | None, torch.cuda.CUDAGraph | None, str | None]:
        """The decode step captured (recorded, not run: the buffers keep the warm-up's values), or
        why it could not be."""
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=self.side_stream):
                logits = self.forward_step()
        except Exception as error:  # a forward that waits on the GPU: eager from here on
            torch.cuda.synchronize(self.slot.device)
            return None, None, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        return logits, graph, None

    def close(self) -> None:
        """The cache and the graph's memory back to the allocator."""
        self.graph = self.graph_logits = self.cache = None
