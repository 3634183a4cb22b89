"""One forward pass over many sessions' steps: the scheduler's seam, and the batched pass.

A service submits a `Pass`, which is data: the session, the prefix its cache must hold, the
tokens to append, a segment to score and forget (a proposer's tree), and how many logits
rows it needs. It gets `PassOutput` back. Rollback, sampling and scoring stay in the
service; the `StepScheduler` sees every pass and merges the ones that are ready.

A batched pass flattens every session's new tokens into one row [1, T], each at its own
positions, and attends session by session: a token sees its own session's cache and,
causally, its own session's tokens (a segment token: the rows its `visible` names), never
another session's. The KV stays in each session's own `DynamicCache`: a `BatchCache` hands
each layer's new keys and values to the sessions' caches and keeps what each then holds, and
the attention runs per session over exactly that, with a mask made on the device from the
session's lengths (`lm.Rows.mask`; none for a one-token row). So rollback stays `crop`,
eviction stays dropping a cache, no session's KV is copied into a shared tensor, and nothing
here reaches into transformers' internals beyond the cache's `update` and the attention
interface. What crosses to the device per pass is the ids, the positions, the rows whose
logits are kept, and a segment's small `visible` matrix. (NOTE: on a GPU this is one sdpa
call per session per layer; a varlen or paged kernel would make it one per layer.)

A batch of one runs exactly the per-session pass (the model's own mask); a tree's pass
alone runs as a batch of one where batched passes serve the model. Batched
logits differ from it by float rounding (about 1e-6 in float32), the same caveat as a
block of k+1 tokens against k+1 single-token passes.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from tandem import host, models, sampling
from tandem.kv import KVSession, Segment, SessionTable, tree_segment
from tandem.lm import BatchCache, CausalLM, Layout, Rows
from tandem.split import NO_SPLIT, PassSplit

log = logging.getLogger(__name__)

EMPTY_SEGMENT = Segment((), (), torch.zeros(0, 0, dtype=torch.bool))
@dataclass
class PassCosts:
    """v(T): how long this scheduler's passes of T tokens take (ms), as measured: a moving
    average by size, seeded with the passes the service timed at start-up. A size not measured
    is read off the line through its measured neighbours (past the largest, on the last two's
    slope; below the smallest, as the smallest)."""

    ms: dict[int, float] = field(default_factory=dict)
    weight: float = 0.2

    def seed(self, times: Mapping[int, float]) -> None:
        for tokens, ms in times.items():
            self.ms.setdefault(tokens, ms)

    def add(self, tokens: int, ms: float) -> None:
        old = self.ms.get(tokens)
        self.ms[tokens] = ms if old is None else old + self.weight * (ms - old)

    def __call__(self, tokens: int) -> float | None:
        if tokens in self.ms:
            return self.ms[tokens]
        below = sorted(t for t in self.ms if t < tokens)
        above = sorted(t for t in self.ms if t > tokens)
        if not below:
            return self.ms[above[0]] if above else None
        lo = below[-1]
        if above:
            hi = above[0]
            return self.ms[lo] + (self.ms[hi] - self.ms[lo]) * (tokens - lo) / (hi - lo)
        if len(below) == 1:
            return self.ms[lo] * tokens / lo  # one size known: no saving is claimed for more
        before = below[-2]
        slope = max(0.0, (self.ms[lo] - self.ms[before]) / (lo - before))
        return self.ms[lo] + slope * (tokens - lo)

    def saving_ms(self, a: int, b: int) -> float:
        """What one pass of a + b tokens saves against a pass of a and another of b."""
        va, vb, both = self(a), self(b), self(a + b)
        return 0.0 if va is None or vb is None or both is None else va + vb - both


@dataclass(frozen=True)
class Expected:
    """A session of the last passes that is expected back: in `due_s` (its last return after
    its last pass ended), at the latest in `latest_s` (twice that), with `tokens` (its last
    pass's)."""

    due_s: float
    latest_s: float
    tokens: int


def awaited(expected: Sequence[Expected], queued_tokens: int, room_sessions: int, room_tokens: int,
            costs: PassCosts) -> float:
    """How long a tick waits (s) before it runs the `queued_tokens` queued: until the sessions
    expected back whose joining saves more of the model's time than the wait costs.

    Taken earliest first, each session expected is waited for while the wait it adds (its due
    time past the one before's) is less than the pass its joining saves: v(P) + v(n) - v(P + n),
    P the tokens the pass holds so far, n the session's. On a flat v (a GPU; a CPU's small
    blocks on oneDNN) that is a pass's fixed cost, worth a wait of nearly a pass; where v
    rises with every token (compute-bound), nothing is. The wait lasts until the chosen
    sessions' latest return; 0: run now.
    """
    wait_s, waited_s, tokens = 0.0, 0.0, queued_tokens
    for n, session in enumerate(sorted(expected, key=lambda e: e.due_s), start=1):
        due_s = max(0.0, session.due_s)
        if n > room_sessions or tokens + session.tokens > room_tokens \
                or costs.saving_ms(tokens, session.tokens) / 1000.0 <= due_s - waited_s:
            break
        tokens += session.tokens
        waited_s, wait_s = due_s, max(wait_s, session.latest_s)
    return wait_s


#: What a step reads from its pass, run on the worker right after the forward, where the
#: logits are (the model's device): the pass's `PassOutput` -> the few values the step needs,
#: read to the host through `host.values` / `host.to_host`.
Reduce = Callable[["PassOutput"], Any]


@dataclass(frozen=True, eq=False)
class Reads:
    """What a step reads of its pass's kept rows; the runner picks its path from it."""

    argmax: bool = False  # greedy scoring: each row's argmax, where nothing below needs more
    masks: torch.Tensor | None = None  # [rows, vocab] bool: the tokens a grammar allows at each row
    top_logprobs: int | None = None  # each row's log-probabilities and its top N (None: none)

    @property
    def argmax_only(self) -> bool:
        """Each row's argmax is all the step reads: a runner whose head reads it slice by slice
        (tandem.head) keeps no logits then (`PassOutput.logits` is None, `best` is set)."""
        return self.argmax and self.masks is None and self.top_logprobs is None


ALL_ROWS = Reads()


@dataclass(frozen=True, eq=False)
class Pass:
    """One session's part of a forward pass."""

    session: KVSession
    cache_position: int  # the cache is cut back to this prefix first
    token_ids: tuple[int, ...]  # [n] appended, and kept in the cache
    logits_to_keep: int = 1  # the last rows over token_ids (then every segment row)
    segment: Segment = EMPTY_SEGMENT  # [t] scored after token_ids, then forgotten
    with_hidden: bool = False  # the last hidden states at the same rows
    reads: Reads = ALL_ROWS  # what the step reads of the kept rows
    reduce: Reduce | None = None  # what the step reads of the logits (PassOutput.value)
    # A run of passes (a decode run): called on the forward worker with this pass's output, it
    # names the session's next pass, queued at once (behind passes already waiting, as any
    # pass) under the same call, so the run goes on without a return to the event loop; None ends the run, and this output
    # answers the call. It must be quick and must not touch the event loop's state except
    # through `loop.call_soon_threadsafe`.
    then: Callable[[PassOutput], Pass | None] | None = None
    # Drafting ahead: a pass no step waits for, optional until this is set (a step arrived
    # that needs it); it yields to steps' passes (StepScheduler._batch).
    optional_until: asyncio.Event | None = None

    @property
    def required(self) -> bool:
        # Event.is_set() only reads a flag: safe from the worker thread.
        return self.optional_until is None or self.optional_until.is_set()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + len(self.segment.token_ids)


@dataclass(frozen=True)
class PassOutput:
    # [logits_to_keep + t, vocab], on the model's device, in its dtype; None for a greedy pass
    # whose runner read the argmax inside the head
    logits: torch.Tensor | None
    hidden: torch.Tensor | None  # [logits_to_keep + t, hidden], likewise
    best: torch.Tensor | None = None  # a greedy pass's argmax of each row [rows], on the device
    value: Any = None  # what the pass's `reduce` returned (None without one)


def finish(p: Pass, logits: torch.Tensor | None, hidden: torch.Tensor | None,
           best: torch.Tensor | None = None) -> PassOutput:
    """A pass's output: its rows (or, greedy, their argmax), and what its step reads of them
    (`Pass.reduce`)."""
    if p.reads.argmax_only and best is None:
        assert logits is not None
        best = sampling.argmax(logits.to(torch.float32))
    out = PassOutput(logits, hidden, best)
    return replace(out, value=p.reduce(out)) if p.reduce is not None else out


#: How a service runs a pass: the host's scheduler, or `direct` in tests and tools.
Forward = Callable[[Pass], Awaitable[PassOutput]]


def _sdpa_by_session(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, *args: Any, tandem_batch: BatchCache | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' sdpa; in a batched pass (`tandem_batch`), one session at a time.

    Each session's rows attend over its own cache as that cache holds it (`BatchCache.held`:
    no concatenation), under its own mask, built from its lengths on the device
    (`Rows.mask`): no mask spans two sessions and no score between two is computed, and
    one-token rows use sdpa's grouped-query path. `key` and `value` (the pass's new
    tokens) and `attention_mask` (a placeholder) are not read then.
    """
    if tandem_batch is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
    # query: [1, heads, T, dim]; each held key, value: [1, kv_heads, keys, dim]
    outputs, q0 = [], 0
    masks = tandem_batch.masks(query.device)
    for rows, (keys, values), mask in zip(tandem_batch.layout.rows, tandem_batch.held, masks, strict=True):
        out, _ = sdpa_attention_forward(module, query[:, :, q0:q0 + rows.queries], keys, values, mask,
                                        *args, **kwargs)
        outputs.append(out)  # [1, rows, heads, dim]
        q0 += rows.queries
    return torch.cat(outputs, dim=1), None


#: The attention a served model runs: transformers' sdpa, one session at a time in a batched pass.
BATCHED_ATTENTION = "tandem_sdpa"


def use_batched_attention(model: CausalLM) -> None:
    """Let a model that runs sdpa attend one session at a time in its batched passes (see
    `_sdpa_by_session`; outside them it is sdpa itself). The service calls it on the model it
    loads; other models in the process keep their attention."""
    if model.config._attn_implementation != "sdpa":
        return
    AttentionInterface.register(BATCHED_ATTENTION, _sdpa_by_session)
    AttentionMaskInterface.register(BATCHED_ATTENTION, sdpa_mask)
    model.set_attn_implementation(BATCHED_ATTENTION)


def last_rows(n: int, keep: int, device: torch.device) -> torch.Tensor:
    """`logits_to_keep` for the last `keep` of n rows, as indices: the model then gathers them
    into a fresh tensor. An int makes it slice a strided view, which torch (2.13, CPU, bf16)
    projects onto the vocabulary by first copying the whole head weight: 1 s a pass for
    Qwen2.5-1.5B, whatever n."""
    return torch.arange(n - keep, n, device=device)


@torch.inference_mode()
def forward(session: KVSession, model: CausalLM, token_ids: list[int], logits_to_keep: int) -> torch.Tensor:
    """Append token_ids to the session's cache; return the last `logits_to_keep` logits [n, vocab] (on the
    model's device, in its dtype)."""
    device = model.get_input_embeddings().weight.device
    ids = torch.tensor([token_ids], dtype=torch.long, device=device)
    # transformers >= 5.24 names the argument `cache` (past_key_values is deprecated); the
    # DynamicCache is updated in place.
    with host.forward(device):
        out = model(input_ids=ids, cache=session.cache, use_cache=True,
                    logits_to_keep=last_rows(len(token_ids), logits_to_keep, device))
    logits: torch.Tensor = out.logits[0, -logits_to_keep:]
    return logits


@torch.inference_mode()
def forward_best(session: KVSession, model: CausalLM, head: Any, token_ids: list[int], rows: int) -> torch.Tensor:
    """`forward`, reading only the argmax id of each of the last `rows` rows [rows] (on the
    model's device), through the model's decoder and `head` (tandem.head.VocabChunks)."""
    device = model.get_input_embeddings().weight.device
    ids = torch.tensor([token_ids], dtype=torch.long, device=device)
    with host.forward(device):
        states = model.get_decoder()(input_ids=ids, cache=session.cache, use_cache=True).last_hidden_state
        best: torch.Tensor = head.argmax(states[0, -rows:])
    return best


@torch.inference_mode()
def forward_segment(session: KVSession, model: CausalLM, token_ids: list[int], segment: Segment,
                    with_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Append token_ids (history), score `segment` after them in the same pass, forget the segment.

    Returns logits [1 + t, vocab] (on the model's device) after the last history token and after each
    segment token, and with_hidden the last hidden states [1 + t, hidden] at those
    positions. The cache ends holding exactly the history: the segment's entries sit at
    non-sequential positions, so they are cropped and never reused.
    """
    device = model.get_input_embeddings().weight.device
    dtype = model.get_input_embeddings().weight.dtype
    cached, n, t = session.length, len(token_ids), len(segment.token_ids)
    where: dict[str, torch.Tensor] = {}  # no segment: the model's own mask (sliding windows too)
    if t:
        rows = Rows(cached, n, segment.offsets, segment.visible)
        allowed = rows.mask(None, device)  # [1, 1, n + t, cached + n + t]
        assert allowed is not None  # a segment always has one
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
        where = {"attention_mask": mask, "position_ids": torch.tensor([rows.positions()], device=device)}
    with host.forward(device):
        out = model(input_ids=torch.tensor([[*token_ids, *segment.token_ids]], device=device),
                    cache=session.cache, use_cache=True, output_hidden_states=with_hidden,
                    logits_to_keep=last_rows(n + t, t + 1, device), **where)
    session.rollback(cached + n)
    logits: torch.Tensor = out.logits[0]
    hidden = out.hidden_states[-1][0, n - 1:] if with_hidden else None
    return logits, hidden


def single(model: CausalLM, p: Pass, head: Any = None) -> PassOutput:
    """A pass on its own: the per-session forward, with the model's own mask. `head`: the
    model's `tandem.head.VocabChunks`, where installed."""
    p.session.extend(p.cache_position, p.token_ids)
    if not p.segment.token_ids and not p.with_hidden:
        if p.reads.argmax_only and head is not None:
            return finish(p, None, None, forward_best(p.session, model, head, list(p.token_ids), p.logits_to_keep))
        return finish(p, forward(p.session, model, list(p.token_ids), p.logits_to_keep), None)
    assert p.logits_to_keep == 1, "a pass with a segment or hidden states keeps one history row"
    logits, hidden = forward_segment(p.session, model, list(p.token_ids), p.segment, p.with_hidden)
    return finish(p, logits, hidden)


@torch.inference_mode()
def batched(model: CausalLM, passes: list[Pass], window: int | None,
            buckets: tuple[int, ...] = (), head: Any = None) -> list[PassOutput]:
    """Several sessions' passes as one forward (see the module docstring).

    With `buckets`, the row is padded up to the smallest bucket that holds it, so that a
    GPU sees a few shapes only (CUDA graphs are captured per shape): the padding tokens are
    a scratch session of their own, with a scratch cache, and no logits are kept for them.
    With `head` (the model's `tandem.head.VocabChunks`) and a greedy pass among them, the
    decoder runs alone and each pass's rows go through the head as the pass reads them.
    """
    device = model.get_input_embeddings().weight.device
    ids: list[int] = []
    positions: list[int] = []
    kept: list[int] = []  # indices into the flat row whose logits are kept, pass by pass
    layout: list[Rows] = []
    caches: list[DynamicCache] = []
    for p in passes:
        p.session.extend(p.cache_position, p.token_ids)
        rows = Rows(p.session.length, len(p.token_ids), p.segment.offsets,
                    p.segment.visible if p.segment.token_ids else None)
        kept.extend(len(ids) + r for r in range(rows.new - p.logits_to_keep, rows.queries))
        ids.extend((*p.token_ids, *p.segment.token_ids))
        positions.extend(rows.positions())
        layout.append(rows)
        caches.append(p.session.cache)
    pad = next((b for b in sorted(buckets) if b >= len(ids)), len(ids)) - len(ids)
    if pad:
        scratch = Rows(0, pad)
        ids.extend([0] * pad)
        positions.extend(scratch.positions())
        layout.append(scratch)
        caches.append(DynamicCache())
    batch = BatchCache(caches, Layout(tuple(layout), window))
    with_hidden = any(p.with_hidden for p in passes)
    sliced = head is not None and not with_hidden and any(p.reads.argmax_only for p in passes)
    spans: list[tuple[int, int]] = []
    for p in passes:
        start = spans[-1][1] if spans else 0
        spans.append((start, start + p.logits_to_keep + len(p.segment.token_ids)))
    inputs = {"input_ids": torch.tensor([ids], device=device),
              "position_ids": torch.tensor([positions], device=device), **batch.call_kwargs(device)}
    read: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []  # (logits, best) of each pass
    with host.forward(device):
        if sliced:
            states = model.get_decoder()(**inputs).last_hidden_state[0, kept]  # [len(kept), hidden]
            read = _read_sliced(head, states, passes, spans)
        else:
            out = model(output_hidden_states=with_hidden, logits_to_keep=torch.tensor(kept, device=device), **inputs)
    if not sliced:
        logits = out.logits[0]  # [len(kept), vocab], on the device
        read = [(logits[a:b], None) for a, b in spans]
    hidden = out.hidden_states[-1][0, kept] if with_hidden else None
    outputs = []
    for p, rows, (a, b), (rows_logits, best) in zip(passes, layout[:len(passes)], spans, read, strict=True):
        if p.segment.token_ids:  # the segment sat at tree positions: forget it
            p.session.rollback(rows.cached + rows.new)
        outputs.append(finish(p, rows_logits, hidden[a:b] if p.with_hidden and hidden is not None else None,
                              best))
    return outputs


def direct(model: CausalLM) -> Forward:
    """Run each pass at once, on its own (tests and tools: no scheduler, no batching)."""
    async def forward(p: Pass) -> PassOutput:
        return single(model, p)
    return forward


def _read_sliced(head: Any, states: torch.Tensor, passes: list[Pass],
                 spans: list[tuple[int, int]]) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
    """(logits, best) of each pass from its kept rows' hidden states: every greedy pass's rows
    through one sliced argmax (the head's weight read once for them all), the other passes'
    rows through the whole head."""
    def read(greedy: bool, through: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[torch.Tensor]:
        mine = [(a, b) for p, (a, b) in zip(passes, spans, strict=True) if p.reads.argmax_only == greedy]
        if not mine:
            return iter(())
        out = through(states[[i for a, b in mine for i in range(a, b)]])
        return iter(torch.split(out, [b - a for a, b in mine]))
    best, logits = read(True, head.argmax), read(False, head)
    return [(None, next(best)) if p.reads.argmax_only else (next(logits), None) for p in passes]


def batching_refusal(model: CausalLM) -> str | None:
    """Why this model's sessions cannot share a pass (None: they can).

    Beyond what its config says, one probe: two short sessions in one batched pass must get
    the logits each gets alone (to float rounding), so an architecture that ignores the
    hand-built mask or positions is found at start-up, not in someone's output.
    """
    config = model.config.get_text_config()
    layer_types = set(getattr(config, "layer_types", None) or ())
    if len(layer_types) > 1:
        return (f"its layers mix attention types ({', '.join(sorted(layer_types))}), and one "
                "hand-built mask serves all layers")
    vocab = models.logits_width(model)
    a, b = KVSession("probe-a", vocab), KVSession("probe-b", vocab)
    try:
        batched(model, [Pass(a, 0, (1, 2, 3)), Pass(b, 0, (2, 1))], models.sliding_window(model))
        together = batched(model, [Pass(a, 3, (2,), 1, tree_segment((1, 3), (-1, 0))),
                                   Pass(b, 2, (3, 3), 2)], models.sliding_window(model))
        alone = [single(model, Pass(KVSession("c", vocab), 0, (1, 2, 3, 2), 1, tree_segment((1, 3), (-1, 0)))),
                 single(model, Pass(KVSession("d", vocab), 0, (2, 1, 3, 3), 2))]
    except Exception as exc:  # noqa: BLE001 - any failure means: do not batch this model
        return f"a batched probe pass failed ({type(exc).__name__}: {exc})"
    for got, want in zip(together, alone, strict=True):
        moved = probe_moved(got.logits, want.logits)
        if moved is not None:
            return (f"a batched probe pass did not reproduce the sessions' own probabilities "
                    f"(moved by {moved:.2g})")
    return None


def probe_moved(got: torch.Tensor | None, want: torch.Tensor | None) -> float | None:
    """How far a start-up probe's probabilities moved from the model's own forward, where that
    is past the dtype's rounding (None: within it). A pass over more tokens, or over a longer
    masked cache, rounds differently; a leak across sessions or a lost position moves them by
    far more. (A probe's passes keep their logits: none is greedy.)"""
    assert got is not None and want is not None
    tolerance = 1e-4 if want.dtype == torch.float32 else 2e-2
    moved = float((torch.softmax(got.float(), -1) - torch.softmax(want.float(), -1)).abs().max())
    return moved if moved > tolerance else None


class Runner(Protocol):
    """What the scheduler's worker runs passes on: a Hugging Face model's own forward
    (`TorchRunner`), or another engine's (tandem.llama). Every method runs on the worker."""

    def single(self, p: Pass) -> PassOutput:
        """One session's pass on its own."""

    def batched(self, passes: list[Pass], buckets: tuple[int, ...]) -> list[PassOutput]:
        """Several sessions' passes as one forward (`buckets`: pad its tokens to one of them)."""

    def cut(self, session: KVSession, length: int) -> None:
        """After a failed pass: cut the session's cache back to `length`, however far it got."""

    def stoppable(self) -> list[torch.nn.Module]:
        """Modules before each of which a running pass may stop (PassAborted)."""


@dataclass
class TorchRunner:
    """Passes through a Hugging Face model's forward: `single` and `batched` above."""

    model: CausalLM
    # A decode run's one-token passes alone, through a static slot (tandem.decode_graph.DecodeGraph).
    decode: Any = None
    # The model's head read slice by slice, for greedy passes (tandem.head.VocabChunks).
    head: Any = None

    def single(self, p: Pass) -> PassOutput:
        if self.decode is not None and self.decode.fits(p):
            return self.decode.run(p)  # type: ignore[no-any-return]
        return single(self.model, p, self.head)

    def batched(self, passes: list[Pass], buckets: tuple[int, ...]) -> list[PassOutput]:
        return batched(self.model, passes, models.sliding_window(self.model), buckets, self.head)

    def cut(self, session: KVSession, length: int) -> None:
        _cut(session.cache, length)

    def stoppable(self) -> list[torch.nn.Module]:
        """The decoder layers, where a pass may stop between two; none for a tensor-parallel
        rank 0 (`Lockstep`, not a module: every rank must finish each call)."""
        model = self.model
        layers = getattr(getattr(model, "model", None), "layers", None) if isinstance(model, torch.nn.Module) else None
        return list(layers) if isinstance(layers, torch.nn.ModuleList) else []


def pass_times(runner: Runner, new_session: Callable[[str], KVSession], tokens: Sequence[int],
               sessions: int = 1, context: int = 64, repeats: int = 3) -> dict[int, float]:
    """v(T) on `runner`: for each T in `tokens`, the median ms of one pass in which each of
    `sessions` sessions, holding `context` cached tokens, adds T new ones with every row's
    logits kept (a warm-up pass first)."""
    generator = torch.Generator().manual_seed(0)
    held = [new_session(f"timing{i}") for i in range(sessions)]
    high = min(1000, held[0].vocab_size)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(2, high, (n,), generator=generator).tolist())

    for s in held:
        runner.single(Pass(s, 0, ids(context)))
    out = {}
    for t in tokens:
        samples = []
        for i in range(repeats + 1):
            passes = [Pass(s, context, ids(t), logits_to_keep=t) for s in held]
            started = time.perf_counter()
            if sessions == 1:
                runner.single(passes[0])
            else:
                runner.batched(passes, ())
            if i:
                samples.append((time.perf_counter() - started) * 1000.0)
        out[t] = statistics.median(samples)
    return out


class PassAborted(Exception):
    """Every step waiting on the running pass was cancelled: it stops at the next layer."""


@dataclass
class _Queued:
    p: Pass
    future: asyncio.Future[PassOutput]
    loop: asyncio.AbstractEventLoop
    queued: float = field(default_factory=time.perf_counter)


@dataclass
class _Recent:
    session: KVSession
    away_s: float | None = None
    ended: float = 0.0  # 0: back since (queued or in a pass)
    tokens: int = 1


@dataclass(frozen=True)
class BatchStats:
    """One forward pass of the scheduler: what a step reports of the pass that served it."""

    sessions: int
    tokens: int
    ms: float = 0.0
    split: PassSplit = NO_SPLIT  # where the pass's time went


class StepScheduler:
    """Runs every pass on one worker thread, as many sessions' passes per forward as are ready.

    Each tick takes the passes queued (oldest first, one per session: a session's passes are
    sequential) up to `max_sessions` and `max_tokens`, and runs them as one forward. With
    max_sessions 1 it runs one session a pass. The event loop stays free for I/O.
    """

    def __init__(self, max_sessions: int, max_tokens: int,
                 on_batch: Callable[[BatchStats], None] = lambda stats: None,
                 sessions: SessionTable | None = None, buckets: tuple[int, ...] = ()) -> None:
        self.max_sessions = max_sessions
        self.max_tokens = max_tokens
        self.buckets = buckets  # pad every pass's tokens to one of these (GPU shapes)
        self.costs = PassCosts()  # v(T) of this scheduler's passes, for the waits (see awaited)
        self._last: set[int] = set()  # sessions of the last pass
        # Sessions of the last two passes: the session, the time its last return took (from the
        # end of its pass to its next pass arriving; None: not back since it was first
        # served), when its last pass ended, and that pass's tokens.
        self._recent: dict[int, _Recent] = {}
        self.on_batch = on_batch
        self.sessions = sessions  # told when a session's passes are over (room may free)
        self._queue: deque[_Queued] = deque()
        self._ready = threading.Condition()
        self._runner: Runner | None = None
        self._running: list[_Queued] = []  # the pass on the worker now
        self._shared = True  # the runner's batched passes serve this model (no refusal)

    def start(self, runner: Runner, refusal: str | None, pass_times: Mapping[int, float] | None = None) -> None:
        """Serve passes on `runner`; `refusal`: why its sessions cannot share a pass (None:
        they can); `pass_times`: v(T) as timed at start-up, until passes measure it."""
        self.costs.seed(pass_times or {})
        if refusal is not None and (self.max_sessions > 1 or self.buckets):
            log.warning("sessions of this model run one per forward pass, unpadded: %s", refusal)
            self.max_sessions, self.buckets = 1, ()
        self._shared = refusal is None
        self._runner = runner
        for layer in runner.stoppable():
            layer.register_forward_pre_hook(self._stop_if_unwanted)
        threading.Thread(target=self._run, name="forward", daemon=True).start()

    def _stop_if_unwanted(self, module: torch.nn.Module, args: Any) -> None:
        """Before each layer: a pass nobody waits for any more (its steps were cancelled, as
        drafting ahead's guesses are when the outcome rules them out) stops here rather than
        delay the pass that replaces it by the rest of its layers."""
        if torch.compiler.is_compiling():
            return  # traced into a compiled step (tandem.decode_graph), which runs whole
        running = self._running
        # Future.cancelled() only reads the future's state: safe from this thread.
        if running and all(q.future.cancelled() for q in running):
            raise PassAborted

    def _expected(self) -> list[Expected]:
        """The recent sessions not queued whose return is known and not yet overdue (with
        `_ready` held)."""
        now, queued = time.perf_counter(), {id(q.p.session) for q in self._queue}
        expected = []
        for sid, r in self._recent.items():
            if sid in queued or r.away_s is None or not r.ended or r.session.closed or r.session.evicted:
                continue
            latest = r.ended + 2 * r.away_s + 0.002 - now  # 2 ms: a wake-up's slack
            if latest > 0:
                expected.append(Expected(r.ended + r.away_s - now, latest, r.tokens))
        return expected

    @property
    def depth(self) -> int:
        """Passes waiting for the worker."""
        return len(self._queue)

    async def __call__(self, p: Pass) -> PassOutput:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[PassOutput] = loop.create_future()
        p.session.check_alive()  # evicted between its passes: NOT_FOUND
        p.session.pending += 1  # until the worker has run or skipped it (`_over`)
        with self._ready:
            recent = self._recent.get(id(p.session))
            if recent is not None and recent.ended and p.required:
                recent.away_s, recent.ended = time.perf_counter() - recent.ended, 0.0
            self._queue.append(_Queued(p, future, loop))
            self._ready.notify()
        return await future

    def _take(self) -> list[_Queued]:
        with self._ready:
            while not self._queue:
                self._ready.wait()
            # Sessions served by the last two passes are usually a round trip away from their
            # next pass (or a draft's block, at a target). Without a wait for them, sessions
            # fall into cohorts that take turns, each arriving while the other's pass runs, and
            # never share one; a wait pays where their joining saves the model a pass.
            while len(self._queue) < self.max_sessions:
                wait_s = awaited(self._expected(), sum(q.p.num_tokens for q in self._queue),
                                 self.max_sessions - len(self._queue), self.max_tokens, self.costs)
                if wait_s <= 0:
                    break
                self._ready.wait(wait_s)
            return self._batch()

    def _batch(self) -> list[_Queued]:
        """The queued passes this tick runs (with `_ready` held): oldest first, one per
        session, within max_sessions and max_tokens (a first pass over it runs alone).
        Drafting ahead's passes yield to steps' passes: where a step's pass is queued, one
        joins only if it adds less to the pass than a pass of its own would cost beyond its
        rows, v(P + n) - v(P) <= v(P) + v(n) - v(P + n): always on a flat v, never where every
        row costs its own share (a compute-bound draft, whose guesses would otherwise slow
        every step's block). Otherwise they run when no step's pass is queued."""
        queue = list(self._queue)
        steps = [q for q in queue if q.p.required]
        order = [*steps, *(q for q in queue if not q.p.required)] if steps else queue
        batch: list[_Queued] = []
        tokens, sessions = 0, set()
        for item in order:
            if len(batch) == self.max_sessions:
                break
            n = item.p.num_tokens
            if id(item.p.session) in sessions or (batch and tokens + n > self.max_tokens):
                continue
            if steps and not item.p.required and not self._rides_free(tokens, n):
                continue
            batch.append(item)
            sessions.add(id(item.p.session))
            tokens += n
        taken = {id(q) for q in batch}
        self._queue = deque(q for q in queue if id(q) not in taken)
        return batch

    def _rides_free(self, tokens: int, more: int) -> bool:
        """v(P + n) - v(P) <= v(P) + v(n) - v(P + n): see `_batch`."""
        grown, now, alone = self.costs(tokens + more), self.costs(tokens), self.costs(more)
        if grown is None or now is None or alone is None:
            return True  # nothing measured yet
        return grown - now <= now + alone - grown

    def _forward(self, live: list[_Queued]) -> list[PassOutput | BaseException]:
        """The passes' outputs, or each one's own error: when a shared pass fails, every
        session is cut back to where it was and its pass runs alone, so one bad pass costs
        only its own step."""
        runner = self._runner
        assert runner is not None
        before = [min(q.p.session.length, q.p.cache_position)
                  for q in live]
        self._running = live
        try:
            # A pass alone runs the model's own forward, except a tree's where batched passes
            # serve the model: its mask then comes from the session's numbers on the device,
            # as in any batched pass, not from a dense one built on the host.
            alone = live[0].p
            if len(live) == 1 and not self.buckets and not (alone.segment.token_ids and self._shared):
                return [runner.single(alone)]
            return list(runner.batched([q.p for q in live], self.buckets))
        except PassAborted as exc:  # every step it served is gone: leave the caches as they were
            for q, length in zip(live, before, strict=True):
                runner.cut(q.p.session, length)
            return [exc] * len(live)
        except BaseException as exc:  # noqa: BLE001 - handed to the step; a shared pass: retried below
            if len(live) == 1:
                return [exc]
            log.warning("a shared pass of %d sessions failed (%s); running them one at a time",
                        len(live), exc)
        finally:
            self._running = []
        outputs: list[PassOutput | BaseException] = []
        for q, length in zip(live, before, strict=True):
            try:
                runner.cut(q.p.session, length)  # every layer, however far the pass got
                outputs.append(runner.single(q.p))
            except BaseException as exc:  # noqa: BLE001 - handed to its own step
                outputs.append(exc)
        return outputs

    def _run(self) -> None:
        while True:
            taken = self._take()
            live = [q for q in taken if not q.future.cancelled()]
            for q in taken:
                if q not in live:
                    try:
                        q.loop.call_soon_threadsafe(self._over, q, None, None)
                    except Exception:
                        log.exception("could not answer a pass")  # e.g. its event loop closed
            if not live:
                continue
            try:
                outputs, stats = self._tick(live)
            except Exception as exc:  # a fault here fails its passes, never the worker
                log.exception("a pass failed outside the model's forward")
                outputs = [exc] * len(live)
                stats = BatchStats(len(live), sum(q.p.num_tokens for q in live))
            for q, output in zip(live, outputs, strict=True):
                try:
                    self._answer(q, output, stats)
                except Exception:
                    log.exception("could not answer a pass")  # e.g. its event loop closed

    def _tick(self, live: list[_Queued]) -> tuple[list[PassOutput | BaseException], BatchStats]:
        """Run one pass of `live`, and record it."""
        clock = host.begin()
        outputs = self._forward(live)
        split = clock.split()
        stats = BatchStats(len(live), sum(q.p.num_tokens for q in live),
                           (time.perf_counter() - clock.started) * 1000.0, split)
        self.costs.add(stats.tokens, stats.ms)
        with self._ready:
            ended, ids = time.perf_counter(), {id(q.p.session) for q in live}
            for q in live:
                if not q.p.required:
                    continue  # drafting ahead: not waited for
                recent = self._recent.setdefault(id(q.p.session), _Recent(q.p.session))
                recent.ended, recent.tokens = ended, q.p.num_tokens
            kept = self._last | ids
            self._recent = {sid: r for sid, r in self._recent.items() if sid in kept}
            self._last = ids
        log.debug("pass: %d sessions, %d tokens, %.0f ms, queued %d after", stats.sessions,
                  stats.tokens, stats.ms, len(self._queue))
        try:
            self.on_batch(stats)
        except Exception:
            log.exception("could not record a pass")  # metrics must never stop the worker
        return outputs, stats

    def _answer(self, q: _Queued, output: PassOutput | BaseException, stats: BatchStats) -> None:
        """Hand a pass's output back to its event loop, or go on with the run it belongs to."""
        if q.p.then is None or isinstance(output, BaseException) or q.future.cancelled():
            q.loop.call_soon_threadsafe(self._over, q, output, stats)
            return
        q.loop.call_soon_threadsafe(self._account, q.p.session, stats)  # before `then` tells of the pass
        following: Pass | None = None
        try:
            following = q.p.then(output)
        except Exception as exc:  # noqa: BLE001 - the run's own error, handed to its call
            output = exc
        if following is None:
            q.loop.call_soon_threadsafe(self._over, q, output, None)
            return
        with self._ready:
            self._queue.append(_Queued(following, q.future, q.loop))

    @staticmethod
    def _account(session: KVSession, stats: BatchStats) -> None:
        session.last_pass = stats  # read by the step once its pass is over
        session.split += stats.split

    def _over(self, q: _Queued, output: PassOutput | BaseException | None, stats: BatchStats | None) -> None:
        """On the event loop: a pass (or a run's last pass) ran (`output`, in the pass `stats`,
        None where a run has told of it already) or was skipped (`output` None)."""
        if stats is not None:
            self._account(q.p.session, stats)
        if output is not None:
            _settle(q.future, output)
        q.p.session.pass_over()
        if self.sessions is not None and not q.p.session.pending:
            self.sessions.changed()  # its room may go to a waiting step now


def _cut(cache: DynamicCache, length: int) -> None:
    """Cut every layer of `cache` back to `length` tokens (after a failed pass, layers may
    hold different lengths, and crop() counts from the first layer's)."""
    layer: Any
    for layer in cache.layers:
        held = int(layer.get_seq_length()) if getattr(layer, "is_initialized", True) else 0
        if held > length:
            layer.crop(length - held)


def _settle(future: asyncio.Future[PassOutput], output: PassOutput | BaseException) -> None:
    if future.done():
        return  # the step was cancelled meanwhile
    if isinstance(output, BaseException):
        future.set_exception(output)
    else:
        future.set_result(output)


def parse_buckets(spec: str, max_tokens: int, device: str) -> tuple[int, ...]:
    """--batch-token-buckets: "auto" and "off" pad nothing (no batched pass is captured as a
    CUDA graph, only a decode run's one-token passes alone are (tandem.decode_graph), so
    padding buys no shape reuse and costs the padded tokens and the batched path for a pass
    alone); or a comma-separated list of sizes to pad to."""
    if spec in ("off", "auto"):
        return ()
    try:
        buckets = tuple(sorted(int(b) for b in spec.split(",")))
    except ValueError:
        raise ValueError(f"--batch-token-buckets must be auto, off or sizes like 8,16,32, got {spec!r}") from None
    if not buckets or buckets[0] < 1:
        raise ValueError(f"--batch-token-buckets sizes must be positive, got {spec!r}")
    return buckets
