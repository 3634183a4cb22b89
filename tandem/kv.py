"""Per-session KV caches on a model service, and the session table that bounds them.

The orchestrator's token history is the source of truth; a cache here is soft state
that holds the KV of a prefix of that history (plus, transiently, drafted tokens).
Every step names `cache_position`, the prefix length it assumes: the cache is cut
back to it (rollback), then the step's new tokens are appended.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, cast

import torch
from transformers import DynamicCache

from tandem.errors import (
    BudgetHeld,
    CacheMismatch,
    InvalidRequest,
    ResourceExhausted,
    SessionEvicted,
)
from tandem.prefix import BLOCK_TOKENS, Entry, PrefixCache
from tandem.split import NO_SPLIT, PassSplit


@dataclass(frozen=True)
class Segment:
    """Tokens scored after a step's history tokens with their own attention pattern.

    A token tree (Medusa, Lookahead's verification branch) or a Jacobi window (Lookahead's
    lookahead branch): each token sees the whole history, plus the segment tokens its
    `visible` row names.
    """

    token_ids: tuple[int, ...]  # [t]
    offsets: tuple[int, ...]  # [t] position past the last history token, minus 1
    visible: torch.Tensor  # [t, t] bool: token i attends to segment token j (i itself included)


def tree_segment(token_ids: tuple[int, ...], parents: tuple[int, ...]) -> Segment:
    """A token tree as a segment: each node sees its ancestors; a root child sits right after history."""
    t = len(token_ids)
    visible = torch.zeros(t, t, dtype=torch.bool)
    depth = [0] * t
    for node, parent in enumerate(parents):
        assert parent < node, "parents must precede their children"
        visible[node, node] = True
        if parent >= 0:
            visible[node] |= visible[parent]
            depth[node] = depth[parent] + 1
    return Segment(tuple(token_ids), tuple(depth), visible)


class SessionState(Protocol):
    """Soft state a proposer keeps beside a session's cache (the draft's q at each position,
    Medusa's next tree, Lookahead's window and pool). Like the cache it
    may be lost at any time and is rebuilt as it goes; unlike the cache it knows nothing of
    the engine, so it is told when the cache is cut."""

    def rollback(self, position: int) -> bool:
        """The cache was cut back to its first `position` tokens (0: a new cache): drop what
        lay past them. False: nothing of the state holds any more, and it is dropped."""
        ...


S = TypeVar("S", bound=SessionState)


class States:
    """A session's soft states, at most one of each type, each rolled back with the cache."""

    def __init__(self) -> None:
        self._held: dict[type[Any], SessionState] = {}

    def get(self, kind: type[S]) -> S | None:
        return cast("S | None", self._held.get(kind))

    def put(self, state: SessionState) -> None:
        self._held[type(state)] = state

    def pop(self, kind: type[S]) -> S | None:
        return cast("S | None", self._held.pop(kind, None))

    def rollback(self, position: int) -> None:
        for kind, state in list(self._held.items()):
            if not state.rollback(position):
                del self._held[kind]

    def clear(self) -> None:
        self._held.clear()

    def __len__(self) -> int:
        return len(self._held)


@dataclass
class KVSession:
    """One session on one model: a handle on its cache (the engine's), the tokens it holds,
    its soft states (rolled back with the cache), and what the session table and the scheduler
    keep of it."""

    session_id: str
    vocab_size: int
    # An empty cache of the service's engine: transformers' DynamicCache, or a llama.cpp
    # sequence (tandem.llama.SeqCache); either has get_seq_length() and crop().
    new_cache: Callable[[], Any] = field(default=DynamicCache, repr=False)
    cache: Any = None  # new_cache() until a pass fills it
    states: States = field(default_factory=States, repr=False)
    # Everything below is the event loop's: the forward worker only runs the passes it is
    # handed (and their caches, while `pending` counts them), and answers through the loop.
    # Budget bookkeeping (SessionTable): tokens this session may hold after its current step,
    # when it was last used, whether its cache was evicted.
    reserved: int = 0
    last_used: int = 0
    # The last forward pass that served this session (a batching.BatchStats), for its reply.
    last_pass: Any = None
    # The passes that served it since its last reply, summed (`take_split`).
    split: PassSplit = NO_SPLIT
    in_step: bool = False  # a step of it is under way: it is not evicted
    evicted: bool = False
    closed: bool = False  # its stream ended (SessionTable.close): no step will touch it again
    # The token ids whose KV the cache holds: the first `length` of them (passes record them).
    token_ids: list[int] = field(default_factory=list)
    # Passes submitted to the scheduler and not yet over (run or skipped); 0: the cache is
    # still, and the session may be evicted or trimmed between steps.
    pending: int = 0
    _still: list[asyncio.Future[None]] = field(default_factory=list, repr=False)
    # Where a speculative tail begins (tokens drafted ahead, which no step has asked for yet);
    # None: none. A tail is the first room the budget takes back (SessionTable.reserve).
    tail_from: int | None = None
    tail_extra: int = 0  # tokens of the tail held outside this cache (copies of it, per guess)
    guesses: Any = None  # the tail's guesses and their copies (draft_service.proposer.Guesses)
    ahead: bool = False  # drafting ahead now: its tail is being written, so it is not trimmed

    def __post_init__(self) -> None:
        if self.cache is None:
            self.cache = self.new_cache()

    @property
    def length(self) -> int:
        return int(self.cache.get_seq_length())

    def take_split(self) -> PassSplit:
        """Where the passes since the last call spent their time, summed; the sum starts again."""
        taken, self.split = self.split, NO_SPLIT
        return taken

    def pass_over(self) -> None:
        """One of its passes ran or was skipped (on the event loop, from the scheduler)."""
        self.pending -= 1
        if not self.pending:
            _wake(self._still)

    async def still(self) -> None:
        """Until no pass of it is queued or running: its cache is still."""
        while self.pending:
            waiter = asyncio.get_running_loop().create_future()
            self._still.append(waiter)
            await waiter

    def check_alive(self) -> None:
        """That the session's cache was not evicted (an evicted session is over)."""
        if self.evicted:
            raise SessionEvicted(
                f"session {self.session_id}'s KV cache was evicted to make room for other "
                "sessions (--kv-budget-tokens); open a new session and resend the history")

    def check_position(self, cache_position: int, held: int | None = None) -> None:
        """That a step may roll back to `cache_position`: the cache is there and holds it
        (`held`: the length the client was told, where that is not the cache's own: a draft
        holds more, drafted ahead, or catches up on its next pass)."""
        self.check_alive()
        held = self.length if held is None else held
        if cache_position > held:
            raise CacheMismatch(
                f"cache_position {cache_position} is beyond the session's cache length "
                f"{held}; resend the history from a position <= {held}"
            )

    def rollback(self, cache_position: int) -> None:
        """Drop cached tokens past `cache_position`, and what the soft states held of them."""
        self.check_position(cache_position)
        if cache_position == self.length:
            return  # nothing to drop
        if cache_position == 0:
            self.cache = self.new_cache()
        else:
            # transformers 5.x: crop() takes the (negative) number of tokens to remove.
            self.cache.crop(cache_position - self.length)
        self.states.rollback(cache_position)

    def extend(self, cache_position: int, token_ids: list[int] | tuple[int, ...]) -> None:
        """Before a pass appends `token_ids` after `cache_position`: roll back, and record them."""
        self.rollback(cache_position)
        del self.token_ids[cache_position:]
        self.token_ids.extend(token_ids)

    @property
    def held_tokens(self) -> list[int]:
        """The tokens the cache holds (read it only while no pass of the session is pending)."""
        return self.token_ids[:self.length]

    def trim_tail(self) -> int:
        """Drop the speculative tail (tokens drafted ahead); how many tokens that freed."""
        if self.tail_from is None or self.evicted:
            return 0
        freed = max(0, self.length - self.tail_from) + self.tail_extra
        if self.length > self.tail_from:
            self.rollback(self.tail_from)
        self.tail_from, self.tail_extra, self.guesses = None, 0, None
        return freed

    def evict(self) -> None:
        """Free the cache. The session is over: its next step gets NOT_FOUND (a step already
        queued included, so its reservation is released too), and the caller rebuilds the
        cache on a new session."""
        free_cache(self.cache)
        self.cache = self.new_cache()
        self.states.clear()
        self.guesses = None
        self.evicted = True

    def check_tokens(self, field_name: str, token_ids: list[int]) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(
                f"{field_name} contains ids outside [0, {self.vocab_size}): {bad[:5]}"
            )


def free_cache(cache: Any) -> None:
    """Free an engine's cache now, where it says how (tandem.llama.SeqCache.release: its cells
    back to the pool), rather than when it is collected; nothing may use it after."""
    release = getattr(cache, "release", None)
    if release is not None:
        release()


def fork_cache(cache: Any, length: int) -> Any:
    """A copy of `cache` cut to its first `length` tokens; the original is left as it is."""
    if not isinstance(cache, DynamicCache):
        return cache.fork(length)  # an engine's own copy (tandem.llama.SeqCache.fork)
    # The layers' tensors are shared, not copied: a draft's cache only ever cuts (a view) or
    # appends (a new tensor), never writes in place, so neither side sees the other's changes.
    # (A target's layers may view the decode graph's slot, which is written in place: drafts
    # only are forked.)
    branch = copy.copy(cache)
    branch.layers = [copy.copy(layer) for layer in cache.layers]
    if length < branch.get_seq_length():
        branch.crop(length - branch.get_seq_length())
    return branch


def copy_cache(cache: DynamicCache) -> DynamicCache:
    """A copy of `cache` whose layers hold tensors of their own."""
    held: DynamicCache = fork_cache(cache, cache.get_seq_length())
    layer: Any
    for layer in held.layers:
        if getattr(layer, "keys", None) is not None:
            layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
    return held


class SessionTable:
    """Live sessions of one service, bounded by `max_sessions` and a KV budget in tokens.

    Before a step, `reserve` claims what the session will hold after it. When the claims
    exceed the budget, other sessions' caches are evicted, least recently used first, unless
    a step of theirs is under way (`in_step`) or a pass of theirs is queued or running
    (`pending`); when only those hold the room, the step waits for them (`room_freed`, after
    BudgetHeld). An evicted session's next step gets NOT_FOUND and the orchestrator rebuilds it
    from its history. A step that cannot fit even so gets RESOURCE_EXHAUSTED, never an
    out-of-memory kill. The table, like its sessions, belongs to the event loop.

    With a prefix cache (`prefix`), a session that ends leaves its cache there (`close`), a
    session's first step may start from it (`start_from_prefix`), and its entries count in the
    budget: they are evicted before any session's cache, after idle sessions' tails.

    The budget counts storage: on transformers each cache's tokens (a copy of a kept prefix
    appends a tensor of its own at its first pass), on llama.cpp the cells of its one pool,
    where a copy shares its source's and a shared prefix counts once (`cells`).
    """

    def __init__(self, max_sessions: int, kv_budget_tokens: int = 0,
                 prefix: PrefixCache | None = None, cells: Any = None) -> None:
        self.max_sessions = max_sessions
        self.kv_budget_tokens = kv_budget_tokens  # 0: no budget
        self.prefix = prefix
        # An engine whose copies share storage (tandem.llama.Cells: each cache's `cells`);
        # None: every cache holds its own tokens (transformers appends a new tensor to a copy).
        self.cells = cells
        self._keeping: set[asyncio.Future[None]] = set()  # closed sessions waiting to be kept
        self._sessions: dict[int, KVSession] = {}
        self._next = 0
        self._clock = 0
        self._room: list[asyncio.Future[None]] = []  # steps waiting for room (room_freed)

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def cached_tokens(self) -> int:
        """Tokens the sessions' caches hold (kept prefixes are free room, and not counted)."""
        if self.cells is not None:
            return int(self.cells.held) - self._frees([], kept=True)
        return sum(s.length for s in self._sessions.values())

    def usage(self) -> float:
        """The share of the KV budget the caches hold, 0 to 1 (0 without a budget)."""
        budget = self.kv_budget_tokens
        return min(1.0, self.cached_tokens / budget) if budget else 0.0

    def _claimed(self, session: KVSession, tokens: int) -> int:
        """What the caches will hold once `session` holds `tokens` and every other session what
        its step under way may add: the caches as they are (kept prefixes included), plus room
        claimed and not yet filled."""
        others = [s for s in self._sessions.values() if s is not session]
        if self.cells is None:
            kept = self.prefix.tokens if self.prefix is not None else 0
            return max(tokens, session.length) + sum(max(s.reserved, s.length) for s in others) + kept
        # A draft's copies of its tail are caches of their own, held already.
        return int(self.cells.held) + max(0, tokens - session.length) + sum(
            max(0, s.reserved - s.length - s.tail_extra) for s in others)

    def _frees(self, sessions: list[KVSession], kept: bool = False) -> int:
        """What evicting `sessions` (and, with `kept`, every kept prefix) would free."""
        if self.cells is None:
            return sum(max(s.reserved, s.length) for s in sessions) + (
                self.prefix.tokens if kept and self.prefix is not None else 0)
        caches = [s.cache.cells for s in sessions]
        if kept and self.prefix is not None:
            caches += [e.cache.cells for e in self.prefix.entries()]
        return int(self.cells.freed_by(caches)) + sum(
            max(0, s.reserved - s.length - s.tail_extra) for s in sessions)

    def _entry_frees(self, entry: Entry) -> bool:
        return self.cells is None or bool(self.cells.freed_by([entry.cache.cells]))

    @property
    def shares_copies(self) -> bool:
        """Whether a copy of a cache shares its tokens' storage (costs only what it adds)."""
        return self.cells is not None

    @property
    def tail_tokens(self) -> int:
        """Tokens held in speculative tails (drafted ahead), over all sessions."""
        return sum(max(0, s.length - s.tail_from) + s.tail_extra for s in self._sessions.values()
                   if s.tail_from is not None)

    def open(self, session_id: str, vocab_size: int,
             new_cache: Callable[[], Any] = DynamicCache) -> tuple[int, KVSession]:
        if len(self._sessions) >= self.max_sessions:
            raise ResourceExhausted(
                f"max_sessions ({self.max_sessions}) sessions are open on this replica; "
                "retry later or raise --max-sessions"
            )
        self._next += 1
        session = KVSession(session_id=session_id, vocab_size=vocab_size, new_cache=new_cache)
        self._sessions[self._next] = session
        return self._next, session

    def reserve(self, session: KVSession, tokens: int, evict: bool = True) -> None:
        """Claim room for `session` to hold `tokens` after its next step, evicting if need be.

        Idle sessions' speculative tails (tokens drafted ahead) go first, then kept prefixes,
        then idle sessions' caches. Nothing is evicted for a step that is refused: for an
        evicted session, or when evicting every idle session would still not make room. With
        evict=False (drafting ahead, which must never cost another session anything) only free
        room is claimed, kept prefixes counting as free.
        """
        session.check_alive()  # an evicted session must not claim room
        self._clock += 1
        session.last_used = self._clock
        budget = self.kv_budget_tokens
        if not budget:
            session.reserved = tokens
            return
        if tokens > budget:
            raise ResourceExhausted(
                f"this step needs {tokens} cached tokens but the replica's KV budget is {budget} "
                "(--kv-budget-tokens); shorten the prompt or max_new_tokens")
        if self._claimed(session, tokens) - self._frees([], kept=True) > budget and not evict:
            raise BudgetHeld(f"no free room in the KV budget ({budget} tokens)")
        others = [s for s in self._sessions.values() if s is not session]
        for s in others:  # tails first: the cheapest room, as nobody has asked for them yet
            if evict and s.tail_from is not None and not s.ahead and not s.pending \
                    and self._claimed(session, tokens) > budget:
                s.trim_tail()
                s.reserved = min(s.reserved, s.length)
        # Then kept prefixes, least recently used first: a cache of what may come again, where
        # an idle session's cache is what will. They are free room to any claim, as cached
        # free blocks are in vLLM: drafting ahead takes them too.
        while self._claimed(session, tokens) > budget and self.prefix is not None \
                and self.prefix.evict_one(self._entry_frees):
            pass
        if not evict:
            session.reserved = tokens
            return
        # Only sessions between steps are evicted, least recently used first: evicting one
        # in the middle of its step would throw its work away, and under pressure sessions
        # would evict each other's steps forever. Room held by steps under way frees when
        # they end (BudgetHeld: the caller waits for it).
        idle = sorted((s for s in others if not s.pending and not s.in_step and s.length + s.reserved),
                      key=lambda s: s.last_used)
        if self._claimed(session, tokens) - self._frees(idle) > budget:
            raise BudgetHeld(
                f"the replica's KV budget ({budget} tokens, --kv-budget-tokens) is held by "
                "other sessions' steps under way; retry, or add replicas")
        session.reserved = tokens
        for victim in idle:
            if self._claimed(session, tokens) <= budget:
                break
            victim.evict()
            victim.reserved = 0

    async def room_freed(self, timeout_s: float) -> None:
        """Until a step ends, a session closes or a session's passes are over (any of which
        may free room), or `timeout_s` passes."""
        waiter = asyncio.get_running_loop().create_future()
        self._room.append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout_s)
        except TimeoutError:
            pass

    def changed(self) -> None:
        """Wake the steps waiting for room: a session's claim may have shrunk."""
        _wake(self._room)

    def settle(self, session: KVSession) -> None:
        """After a step: the session holds what its cache holds."""
        session.reserved = session.length
        self.changed()

    async def kept(self, timeout_s: float) -> None:
        """Until the sessions closed with a pass still running are kept (at most `timeout_s`):
        a conversation's next turn often arrives while its last turn's session is closing."""
        if self._keeping:
            await asyncio.wait(list(self._keeping), timeout=timeout_s)

    def start_from_prefix(self, session: KVSession, token_ids: list[int]) -> int:
        """Before a fresh session's first pass over `token_ids` (its whole history): give it a
        copy of the longest prefix of them that is kept or that a live session holds, all but
        the last token at most (whose logits the step reads); how many tokens that gave it (0:
        none, and nothing changed)."""
        if self.prefix is None or session.length or session.evicted or session.token_ids:
            return 0
        block = list(token_ids[:BLOCK_TOKENS])
        # Live sessions between passes, as they stand: a copy made now holds what they hold now
        # (a transformers cache is shared as an entry's is; a llama.cpp copy is queued before
        # any later pass of theirs; a tensor-parallel copy goes with the next call).
        live = [(s.held_tokens, s.cache) for s in self._sessions.values()
                if s is not session and not (s.evicted or s.closed or s.pending)
                and s.length >= BLOCK_TOKENS and s.token_ids[:BLOCK_TOKENS] == block]
        found = self.prefix.lookup(token_ids, len(token_ids) - 1, live)
        if found is None:
            return 0
        session.cache, length = found
        session.token_ids = list(token_ids[:length])
        return length

    def close(self, handle: int) -> None:
        session = self._sessions.pop(handle, None)
        if session is not None:
            session.closed = True
            if self.prefix is not None and not session.evicted:
                if session.pending:  # a pass still queued or running (drafting ahead's, say)
                    self._keeping.add(task := asyncio.ensure_future(self._keep(session)))
                    task.add_done_callback(self._keeping.discard)
                else:
                    self._keep_now(session)
        self.changed()

    async def _keep(self, session: KVSession) -> None:
        """Once its passes are over (they were cancelled with its stream), keep its cache."""
        await session.still()
        if not session.evicted:
            self._keep_now(session)
            self.changed()

    def _keep_now(self, session: KVSession) -> None:
        assert self.prefix is not None
        session.trim_tail()  # what it drafted ahead: guesses nobody asked for
        self.prefix.insert(session.held_tokens, session.cache)
        session.cache = session.new_cache()


def _wake(waiters: list[asyncio.Future[None]]) -> None:
    """Resolve every waiter still waiting (a cancelled one is done already), and forget them."""
    for waiter in waiters:
        if not waiter.done():
            waiter.set_result(None)
    waiters.clear()
