"""A draft on llama.cpp: GGUF models at the speed of the hardware they run on.

One llama.cpp model and context per draft service (through llama-cpp-python's low-level
bindings of llama.h), one llama.cpp sequence per session cache. The scheduler's worker hands
passes over as data (`batching.Pass`), as it does to a Hugging Face model: every session's
tokens of a tick go into one `llama_decode`, each under its own sequence id, and the logits
rows a pass keeps come back as float32 tensors. Sampling stays Tandem's own
(tandem.sampling), so q and the drawn token are what the transformers backend would make
of the same logits; and since the rejection rule needs only the q the draft sampled from,
the draft's numerics move its acceptance, never the output.

A session's cache (`SeqCache`) is a length kept in Python and a sequence id. llama.cpp's
memory is touched only on the worker thread: a copy (a kept prefix's, drafting ahead's
guesses), a cut (the cells past the new length removed, `llama_memory_seq_rm`) and a release
are queued and applied by the worker, in order, before its next decode. So the event loop
never calls into llama.cpp.

The context's cells are one pool (a unified cache), and a copy shares its source's cells
(`llama_memory_seq_cp`): a system prompt kept once and copied into eight sessions is stored
once. `Cells` keeps the same count in Python, cell by cell with references, so the session
table's KV budget counts what the pool holds, not what each sequence holds.
"""

from __future__ import annotations

import ctypes
import importlib.util
import itertools
import logging
import os
import threading
import weakref
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tandem import host
from tandem.batching import Pass, PassOutput, finish, pass_times
from tandem.errors import ResourceExhausted
from tandem.kv import KVSession

log = logging.getLogger(__name__)

FLASH_ATTENTION_OFF = 0  # llama_flash_attn_type: -1 auto, 0 disabled, 1 enabled
GGML_TYPE_F32 = 0  # ggml.h's enum ggml_type
# The most sequences one llama.cpp context serves (LLAMA_MAX_SEQ in llama.cpp).
MAX_SEQUENCES = 256
# The context's KV cells when the service sets no --kv-budget-tokens: shared by every
# sequence (a unified cache); the session table evicts before it runs out.
DEFAULT_CONTEXT_TOKENS = 32768


class LlamaError(Exception):
    """llama.cpp cannot load the model or run a pass."""


def available() -> bool:
    """Whether llama-cpp-python is installed (it is found, not imported)."""
    return importlib.util.find_spec("llama_cpp") is not None


# ggml's log levels (ggml.h): llama.cpp's warnings and errors go to Python's logging, its
# per-load chatter (hundreds of lines of metadata) to DEBUG.
_WARN, _ERROR, _CONT = 3, 4, 5
_log_callback: Any = None  # the ctypes callback, kept alive for as long as llama.cpp may call it
_errors: list[str] | None = None  # while check() runs: llama.cpp's errors, kept for its answer


def _forward_log(level: int, text: bytes | None, user_data: Any) -> None:
    if level == _CONT or not text:
        return
    line = text.decode(errors="replace").rstrip()
    if _errors is not None:
        if level == _ERROR:
            _errors.append(line)
        return
    log.log(logging.ERROR if level == _ERROR else logging.WARNING if level == _WARN
            else logging.DEBUG, "llama.cpp: %s", line)


def _bindings() -> Any:
    global _log_callback
    try:
        import llama_cpp
    except ImportError as exc:
        raise LlamaError("the llama.cpp backend needs llama-cpp-python: make install builds it "
                         "(or pip install llama-cpp-python)") from exc
    if _log_callback is None:
        _log_callback = llama_cpp.llama_log_callback(_forward_log)
        llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
    return llama_cpp


def offloads_to_gpu() -> bool:
    """Whether this llama-cpp-python was built with a GPU backend (CUDA, ...)."""
    return bool(_bindings().llama_supports_gpu_offload())


def check(path: str) -> None:
    """Refuse, in one line, a file llama.cpp cannot load: its header, vocabulary and
    architecture are read and every tensor's place in the file checked, no weight loaded."""
    global _errors
    lib = _bindings()
    lib.llama_backend_init()
    params = lib.llama_model_default_params()
    params.vocab_only = True
    _errors = []
    try:
        model = lib.llama_model_load_from_file(path.encode(), params)
        errors = _errors
    finally:
        _errors = None
    if not model:
        why = next((e for e in errors if "error loading model:" in e), errors[-1] if errors else "")
        raise LlamaError(f"llama.cpp cannot load {path}" + (
            f": {why.split('error loading model:', 1)[-1].strip()}" if why else ""))
    lib.llama_model_free(model)


@dataclass
class _Slot:
    """A sequence id, once the worker has given the cache one."""

    seq: int | None = None


class Cells:
    """The context's cells in use, as llama.cpp's unified cache holds them: each cache's cells
    (one per position it holds), shared by its copies and counted once. Caches call it from the
    event loop and the worker alike, hence the lock."""

    def __init__(self) -> None:
        self._refs: dict[int, int] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        return len(self._refs)

    def take(self, count: int) -> list[int]:
        with self._lock:
            ids = [next(self._ids) for _ in range(count)]
            self._refs.update(dict.fromkeys(ids, 1))
        return ids

    def share(self, ids: list[int]) -> list[int]:
        with self._lock:
            for i in ids:
                self._refs[i] += 1
        return list(ids)

    def drop(self, ids: list[int]) -> None:
        with self._lock:
            for i in ids:
                if self._refs[i] == 1:
                    del self._refs[i]
                else:
                    self._refs[i] -= 1

    def freed_by(self, caches: list[list[int]]) -> int:
        """The cells that dropping these caches' `cells` would free: those no other cache holds."""
        counts = Counter(i for ids in caches for i in ids)
        with self._lock:
            return sum(self._refs.get(i) == n for i, n in counts.items())


class SeqCache:
    """One session's KV cache in the shared llama.cpp context: get_seq_length() and crop(),
    as a DynamicCache has, fork(length) for a copy of a prefix, and the cells it holds."""

    def __init__(self, engine: LlamaEngine, source: tuple[SeqCache, int] | None = None) -> None:
        self.engine = engine
        self.length = source[1] if source else 0
        self.slot = _Slot()
        # A copy's tokens come from its source, at the worker's next drain.
        self.source = source
        # Its cells in `engine.cells`, one per position: a copy's are its source's.
        self.cells: list[int] = engine.cells.share(source[0].cells[:self.length]) if source else []
        self.release = weakref.finalize(self, engine.release, self.slot, self.cells)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def crop(self, max_length: int) -> None:
        """As DynamicCache.crop in transformers 5.x: remove -max_length tokens from the end."""
        assert max_length < 0, "crop takes the (negative) number of tokens to remove"
        self.cut(self.length + max_length)

    def cut(self, length: int) -> None:
        """Hold the first `length` tokens at most; the cells past them are freed at the worker's
        next drain (a sequence's next pass would remove them anyway, a kept prefix has none)."""
        if length >= self.length:
            return
        self.length = max(0, length)
        self.engine.cells.drop(self.cells[self.length:])
        del self.cells[self.length:]
        if self.slot.seq is not None or self.source is not None:
            self.engine.ops.append(_Cut(weakref.ref(self)))

    def grow(self, count: int) -> None:
        """A decode appended `count` tokens."""
        self.length += count
        self.cells += self.engine.cells.take(count)

    def fork(self, length: int) -> SeqCache:
        copy = SeqCache(self.engine, (self, min(length, self.length)))
        self.engine.ops.append(_Copy(weakref.ref(copy)))
        return copy


# The worker's queued operations name their cache weakly: a cache dropped before they are
# applied is skipped (its release, queued when it went, clears its sequence), so an idle
# engine holds no dropped cache, nor its cells.
@dataclass(eq=False)
class _Cut:
    """Remove a sequence's cells past its length as it is when the worker applies this."""

    cache: weakref.ref[SeqCache]


@dataclass(eq=False)
class _Copy:
    """Give a copy its source's cells (the copy holds its source and length)."""

    cache: weakref.ref[SeqCache]


class LlamaEngine:
    """The llama.cpp model and context of a draft service, and the runner its scheduler
    drives (batching.Runner)."""

    def __init__(self, path: str, *, context_tokens: int, max_batch_tokens: int, threads: int,
                 gpu_layers: int = 0, float32_attention: bool = False, repack: bool = True) -> None:
        lib = self.lib = _bindings()
        lib.llama_backend_init()
        params = lib.llama_model_default_params()
        params.n_gpu_layers = gpu_layers
        # llama.cpp repacks some weight types for its CPU kernels (interleaved rows); those
        # kernels multiply a block's rows in groups and a lone row on its own (see
        # docs/ARCHITECTURE.md, "Exact on llama.cpp").
        params.use_extra_bufts = repack
        self.offloaded = gpu_layers != 0  # the logits come from a device
        self.model = lib.llama_model_load_from_file(path.encode(), params)
        if not self.model:
            raise LlamaError(f"llama.cpp cannot load {path} (not a GGUF model it knows?)")
        ctx_params = lib.llama_context_default_params()
        # A decode may keep one row per sequence, so it holds at least as many tokens.
        self.batch_tokens = max(max_batch_tokens, MAX_SEQUENCES)
        # The cells hold every session's cache (the service's budget bounds them) and one
        # decode's new tokens on top; llama.cpp also caps a decode at the context's size.
        context_tokens += self.batch_tokens
        ctx_params.n_ctx = context_tokens
        ctx_params.n_batch = ctx_params.n_ubatch = self.batch_tokens
        ctx_params.n_seq_max = MAX_SEQUENCES
        ctx_params.kv_unified = True  # one pool of cells for every sequence: copies share cells
        ctx_params.no_perf = True
        if float32_attention:
            # llama.cpp's default is float16 keys and values, and its CPU flash attention
            # rounds through float16 too (about 2e-4 relative): both off, logits match a
            # float32 forward to float32 rounding.
            ctx_params.type_k = ctx_params.type_v = GGML_TYPE_F32
            ctx_params.flash_attn_type = FLASH_ATTENTION_OFF
        # 0: every CPU the process may run on (llama.cpp's own default is a fixed 4).
        ctx_params.n_threads = ctx_params.n_threads_batch = threads or len(os.sched_getaffinity(0))
        self.ctx = lib.llama_init_from_model(self.model, ctx_params)
        if not self.ctx:
            raise LlamaError(f"llama.cpp cannot make a context of {context_tokens} tokens for {path}")
        self.memory = lib.llama_get_memory(self.ctx)
        self.vocab_size = int(lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model)))
        self.context_tokens = context_tokens
        self.threads = int(ctx_params.n_threads)
        self.cache_bytes = 4 if float32_attention else 2
        # Sequence ids free to take; ids of released caches come back once they are cleared.
        self.free = list(range(MAX_SEQUENCES - 1, -1, -1))
        # Copies, cuts and releases (a _Slot), applied by the worker in order.
        self.ops: deque[_Copy | _Cut | _Slot] = deque()
        self.cells = Cells()

    # --- what the service asks of the model --------------------------------------------

    def new_cache(self) -> SeqCache:
        return SeqCache(self)

    def metadata(self, key: str) -> str:
        buf = ctypes.create_string_buffer(256)
        size = self.lib.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode(errors="replace") if size >= 0 else ""

    def describe(self) -> str:
        buf = ctypes.create_string_buffer(256)
        self.lib.llama_model_desc(self.model, buf, len(buf))
        return buf.value.decode(errors="replace")

    @property
    def trained_context(self) -> int:
        return int(self.lib.llama_model_n_ctx_train(self.model))

    def kv_bytes_per_token(self) -> int:
        n_embd = int(self.lib.llama_model_n_embd(self.model))
        heads = int(self.lib.llama_model_n_head(self.model))
        kv_heads = int(self.lib.llama_model_n_head_kv(self.model))
        layers = int(self.lib.llama_model_n_layer(self.model))
        return 2 * layers * kv_heads * (n_embd // heads) * self.cache_bytes  # keys and values

    # --- the worker's side (batching.Runner) --------------------------------------------

    @property
    def held_tokens(self) -> int:
        """The cells every cache holds together (a copy's shared ones once)."""
        return self.cells.held

    def release(self, slot: _Slot, cells: list[int]) -> None:
        """A cache was dropped (any thread): its cells are free, and its sequence is cleared at
        the next drain."""
        self.cells.drop(cells)
        cells.clear()
        if slot.seq is not None:
            self.ops.append(slot)

    def _drain(self) -> None:
        while self.ops:
            op = self.ops.popleft()
            if isinstance(op, _Slot):
                assert op.seq is not None
                self.lib.llama_memory_seq_rm(self.memory, op.seq, 0, -1)
                self.free.append(op.seq)
                continue
            cache = op.cache()
            if cache is None:
                continue
            if isinstance(op, _Cut):
                if cache.slot.seq is not None:
                    self.lib.llama_memory_seq_rm(self.memory, cache.slot.seq, cache.length, -1)
                continue
            assert cache.source is not None
            (source, length), cache.source = cache.source, None
            if not length or source.slot.seq is None or not self.free:
                # Nothing to copy, or no sequence free: the copy starts empty, and its next
                # pass feeds it the whole history (its held tokens are then none).
                cache.cut(0)
                continue
            self.lib.llama_memory_seq_cp(self.memory, source.slot.seq, self._seq(cache), 0, length)

    def _seq(self, cache: SeqCache) -> int:
        if cache.slot.seq is None:
            if not self.free:
                raise ResourceExhausted(f"every one of llama.cpp's {MAX_SEQUENCES} sequences is "
                                        "in use; lower --max-sessions")
            cache.slot.seq = self.free.pop()
        return cache.slot.seq

    def single(self, p: Pass) -> PassOutput:
        return self.batched([p], ())[0]

    def batched(self, passes: list[Pass], buckets: tuple[int, ...]) -> list[PassOutput]:
        self._drain()
        entries: list[tuple[int, int, tuple[int, ...], int]] = []  # seq, start, tokens, kept
        for p in passes:
            if p.segment.token_ids or p.with_hidden:
                raise LlamaError("the llama.cpp draft scores no token trees and keeps no hidden states")
            p.session.extend(p.cache_position, p.token_ids)
            cache: SeqCache = p.session.cache
            seq = self._seq(cache)
            self.lib.llama_memory_seq_rm(self.memory, seq, cache.length, -1)
            entries.append((seq, cache.length, p.token_ids, p.logits_to_keep))
        rows = self._decode(entries)
        for p in passes:
            p.session.cache.grow(len(p.token_ids))
        return [finish(p, r, None) for p, r in zip(passes, rows, strict=True)]

    def _decode(self, entries: list[tuple[int, int, tuple[int, ...], int]]) -> list[torch.Tensor]:
        """Decode the entries' tokens in batches of at most `batch_tokens`; each entry's last
        `kept` rows of logits, [kept, vocab] float32."""
        flat = [(seq, start + i, token, i >= len(tokens) - kept, e)
                for e, (seq, start, tokens, kept) in enumerate(entries)
                for i, token in enumerate(tokens)]
        kept_rows: list[list[torch.Tensor]] = [[] for _ in entries]
        for begin in range(0, len(flat), self.batch_tokens):
            chunk = flat[begin:begin + self.batch_tokens]
            batch = self.lib.llama_batch_init(len(chunk), 0, 1)
            try:
                for i, (seq, pos, token, wanted, _) in enumerate(chunk):
                    batch.token[i], batch.pos[i] = token, pos
                    batch.n_seq_id[i], batch.seq_id[i][0] = 1, seq
                    batch.logits[i] = wanted
                batch.n_tokens = len(chunk)
                with host.forward():
                    status = self.lib.llama_decode(self.ctx, batch)
                if status != 0:
                    raise LlamaError(f"llama_decode failed with status {status} (the context holds "
                                     f"{self.context_tokens} tokens over every sequence)")
                for i, (_, _, _, wanted, e) in enumerate(chunk):
                    if wanted:
                        pointer = self.lib.llama_get_logits_ith(self.ctx, i)
                        row = np.ctypeslib.as_array(pointer, shape=(self.vocab_size,))
                        kept_rows[e].append(torch.from_numpy(row.copy()))
                        if self.offloaded:  # llama.cpp copied the row from the device
                            host.count(row.nbytes)
            finally:
                self.lib.llama_batch_free(batch)
        return [torch.stack(rows) for rows in kept_rows]

    def time_passes(self, tokens: tuple[int, ...]) -> dict[int, float]:
        """v(T) of one sequence's decodes (batching.pass_times; call before serving)."""
        return pass_times(self, lambda name: KVSession(name, self.vocab_size, new_cache=self.new_cache),
                          tokens)

    def cut(self, session: KVSession, length: int) -> None:
        session.cache.cut(length)

    def stoppable(self) -> list[torch.nn.Module]:
        return []

    def close(self) -> None:
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)
