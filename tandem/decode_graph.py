"""A decode run's one-token passes through a static cache and one compiled step.

A pass of one new token for a session alone in its tick, part of a decode run (`Pass.then`),
can run with every shape fixed: the token and its position in one-element device tensors, the
keys and values in a preallocated slot of `max_tokens` positions (transformers' StaticCache),
the mask computed on the device from the position (keys at or before it). With `compile`, that
step is `torch.compile`d whole (`fullgraph`): on a GPU in the reduce-overhead mode, which
captures it as a CUDA graph and replays it per token, with no host work per kernel; on a CPU
by inductor. Without, the same step runs eager (the CPU tests' path).

The session's own DynamicCache stays the one record of its keys and values: while it owns the
slot, each of its layers is a view of the slot's first `length` positions, extended by a view
per step (no copy). Anything else its cache meets (a batched pass, which appends a new tensor;
a rollback, which cuts the view) keeps working as on any DynamicCache; the slot sees that its
owner's layers no longer view it and copies the cache in again before its next captured step.
A new owner first gives the old one its own copy, and takes the slot only while the old owner
has a pass pending (its cache is the worker's then) or is gone: an owner between steps keeps
the slot, and another session's pass runs uncaptured meanwhile. So the only copies are one
per change of owner or of path, never one per token.

At start-up (`warm`) the step is compiled, and a probe checks it against the model's own
forward (torch keeps CUDA graphs per thread: the forward worker records its own on its first
captured passes, from the same compiled code): a step that does not reproduce it, or fails to compile, turns the path
off, logged, and passes run as they do without it.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
from transformers import DynamicCache, StaticCache

from tandem import host, models
from tandem.batching import Pass, PassOutput, finish, probe_moved, single
from tandem.kv import KVSession
from tandem.lm import CausalLM

log = logging.getLogger(__name__)

AUTO, OFF, EAGER, COMPILE = "auto", "off", "eager", "compile"
MODES = (AUTO, OFF, EAGER, COMPILE)


def refusal(model: CausalLM, max_tokens: int) -> str | None:
    """Why this model's decode cannot run through the static slot (None: it can)."""
    config = model.config.get_text_config()
    if len(set(getattr(config, "layer_types", None) or ())) > 1:
        return "its layers mix attention types"
    window = models.sliding_window(model)
    if window is not None:  # the slot's mask is causal only, and a sliding static layer rolls its keys
        return f"its attention has a sliding window ({window} tokens)"
    if getattr(model, "hf_device_map", None) and len(set(model.hf_device_map.values())) > 1:
        return "it is spread over several devices"
    return None


class DecodeGraph:
    """One static slot and its step (see the module docstring). Every method runs on the
    forward worker."""

    def __init__(self, model: CausalLM, max_tokens: int, compiled: bool) -> None:
        weight = model.get_input_embeddings().weight
        self.model, self.max_tokens, self.compiled = model, max_tokens, compiled
        self.device, self.dtype = weight.device, weight.dtype
        self.cache = StaticCache(config=model.config.get_text_config(), max_cache_len=max_tokens)
        self.slots: list[Any] = list(self.cache.layers)  # its layers: keys, values, position counter
        self.ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        self.position = torch.zeros((), dtype=torch.long, device=self.device)
        self.key_positions = torch.arange(max_tokens, device=self.device)
        self._owner: weakref.ref[DynamicCache] | None = None  # whose layers view the slot
        self._owner_session: weakref.ref[KVSession] | None = None
        self._at = -1  # where the slot's position counters stand (-1: not known)
        step = self._step
        if compiled:
            for t in (self.ids, self.position, self.key_positions):
                torch._dynamo.mark_static_address(t)
            mode = "reduce-overhead" if self.device.type == "cuda" else None
            step = torch.compile(self._step, mode=mode, fullgraph=True)
        self._run = step

    def _step(self) -> torch.Tensor:
        """The one-token pass at `position`, all shapes fixed: logits [1, vocab]."""
        allowed = self.key_positions <= self.position
        mask = torch.zeros((), dtype=self.dtype, device=self.device).masked_fill(
            ~allowed, torch.finfo(self.dtype).min).view(1, 1, 1, self.max_tokens)
        out = self.model(input_ids=self.ids, position_ids=self.position.view(1, 1), cache=self.cache,
                         use_cache=True, attention_mask=mask)
        self.position.add_(1)
        logits: torch.Tensor = out.logits[0, -1:]
        return logits

    def fits(self, p: Pass) -> bool:
        """Whether `p` can run through the slot: one token of a decode run, alone, with room."""
        cache = p.session.cache
        return (p.then is not None and len(p.token_ids) == 1 and not p.segment.token_ids
                and not p.with_hidden and p.logits_to_keep == 1 and 0 < p.cache_position < self.max_tokens
                and isinstance(cache, DynamicCache) and len(cache.layers) == len(self.slots)
                and all(getattr(layer, "is_initialized", True) for layer in cache.layers)
                and self._free_for(p.session))

    @staticmethod
    def _shares(mine: Any, slot: Any) -> tuple[bool, bool]:
        """Whether a session's layer keys, values are (views of) the slot layer's."""
        return mine.keys.data_ptr() == slot.keys.data_ptr(), mine.values.data_ptr() == slot.values.data_ptr()

    def _free_for(self, session: KVSession) -> bool:
        """Whether `session` may have the slot: it owns it, or the owner's cache may be touched
        here (a pass of it pending, or its stream over). An owner with no pass pending is
        between steps: its cache is the event loop's then (a step may cut it), so the slot stays
        its own and `session` runs uncaptured."""
        owner = self._owner_session() if self._owner_session is not None else None
        cache: Any = self._owner() if self._owner is not None else None
        if owner is None or owner is session or cache is None or owner.cache is not cache or owner.pending \
                or owner.closed:
            return True
        return not any(any(self._shares(mine, slot)) for mine, slot in zip(cache.layers, self.slots, strict=True))

    @torch.inference_mode()
    def run(self, p: Pass) -> PassOutput:
        session = p.session
        session.extend(p.cache_position, p.token_ids)
        n, layers = session.length, list(session.cache.layers)
        if self._owner is None or self._owner() is not session.cache or not self._viewed(layers, n):
            self._load(session, n)
        if self._at != n:
            for layer in self.slots:
                layer.cumulative_length.fill_(n)
            self.position.fill_(n)
        self.ids.fill_(p.token_ids[0])
        self._at = -1  # until the step is through: a failed one may have moved some counters
        with host.forward(self.device):
            logits = self._run().clone()  # a CUDA graph's output is overwritten by its next replay
        self._at = n + 1
        host.captured()
        for mine, slot in zip(layers, self.slots, strict=True):
            mine.keys, mine.values = slot.keys[:, :, :n + 1], slot.values[:, :, :n + 1]
        return finish(p, logits, None)

    def _viewed(self, layers: list[Any], n: int) -> bool:
        """Whether the owner's layers still view the slot's first n positions."""
        return all(all(self._shares(mine, slot)) and mine.keys.shape[-2] == n
                   for mine, slot in zip(layers, self.slots, strict=True))

    def _load(self, session: KVSession, n: int) -> None:
        """Make `session` the slot's owner: copy its cache's n positions in, and view them from
        then on."""
        self.release()
        cache = session.cache
        for mine, slot in zip(cache.layers, self.slots, strict=True):
            if not slot.is_initialized:
                slot.lazy_initialization(mine.keys, mine.values)
            keys, values = self._shares(mine, slot)
            if not keys:
                slot.keys[:, :, :n].copy_(mine.keys)
            if not values:
                slot.values[:, :, :n].copy_(mine.values)
            mine.keys, mine.values = slot.keys[:, :, :n], slot.values[:, :, :n]
        self._owner, self._owner_session, self._at = weakref.ref(cache), weakref.ref(session), -1

    def release(self) -> None:
        """The owner's layers get copies of their own: the slot is free for another session.
        Called on the worker only while the owner has a pass pending, or is gone (`_free_for`)."""
        owner: Any = self._owner() if self._owner is not None else None
        if owner is not None:
            for mine, slot in zip(owner.layers, self.slots, strict=True):
                keys, values = self._shares(mine, slot)
                if keys:
                    mine.keys = mine.keys.clone()
                if values:
                    mine.values = mine.values.clone()
        self._owner = self._owner_session = None

    def warm(self, steps: int = 3) -> str | None:
        """Compile and capture the step on a scratch session, and check it against the model's
        own forward; why the path is off (None: it is on)."""
        vocab = models.logits_width(self.model)
        prompt, tokens = (1, 2, 3, 4), [5, 6, 7, 8, 9, 10][:steps]

        def then(out: PassOutput) -> None:
            return None

        try:
            captured, plain = KVSession("warm-slot", vocab), KVSession("warm-plain", vocab)
            for s in (captured, plain):
                single(self.model, Pass(s, 0, prompt))
            for i, token in enumerate(tokens):
                got = self.run(Pass(captured, len(prompt) + i, (token,), then=then)).logits
                want = single(self.model, Pass(plain, len(prompt) + i, (token,))).logits
                moved = probe_moved(got, want)
                if moved is not None:
                    return f"its step did not reproduce the model's own forward (moved by {moved:.2g})"
        except Exception as exc:  # noqa: BLE001 - any failure means: do not use the slot
            return f"its step failed ({type(exc).__name__}: {exc})"
        finally:
            self.release()
        return None


def build(model: CausalLM, mode: str, max_tokens: int, device: str) -> DecodeGraph | None:
    """The decode graph --decode-graph asks for, warmed up; None where it is off."""
    if mode not in MODES:
        raise ValueError(f"--decode-graph must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == AUTO:
        mode = COMPILE if device.startswith("cuda") else OFF
    if mode == OFF:
        return None
    tokens = min(max_tokens, models.max_context_tokens(model) or max_tokens)
    why = refusal(model, tokens)
    graph = DecodeGraph(model, tokens, compiled=mode == COMPILE) if why is None else None
    if graph is not None and any(getattr(slot, "is_sliding", False) for slot in graph.slots):
        why = "transformers builds its static cache with sliding-window layers"
    elif graph is not None:
        why = graph.warm()
    if graph is None or why is not None:
        log.warning("decode runs' one-token passes run uncaptured: %s", why)
        return None
    log.info("decode graph: a decode run's one-token passes alone run through a static slot of %d "
             "tokens, %s", tokens, ("compiled" + (" (CUDA graph)" if graph.device.type == "cuda" else ""))
             if graph.compiled else "eager")
    return graph
