"""Which replica takes a new session: the one likely to hold its prefix, within a load bound.

Each replica keeps the KV of the sessions it served (tandem.prefix), so a conversation's next
turn, or another request under the same system prompt, costs only its new tokens there and
its whole prompt anywhere else. A pool routes a new session by its history's blocks
(`BLOCK_TOKENS` tokens each, keyed by a digest of every token up to the block's end, so a key
names a whole prefix):

1. a history that continues one this orchestrator routed (it holds an earlier session's
   whole history to its last block, and no other history has gone past that block since: a
   conversation's next turn, an agent's next call, the choices of an n > 1 request after
   its prefill) goes where that session went, whatever its load: moving it would prefill
   the whole conversation again elsewhere, and a conversation adds no load where it is, it
   only stays;
2. else to the replica this orchestrator last sent the longest of its prefixes to (a shared
   system prompt);
3. else to the replica the first block's key ranks highest by rendezvous hashing, so
   requests that share a first block meet on one replica, every orchestrator picks the same
   one, and a replica joining or leaving moves only the prefixes it wins or held;
2 and 3 each among the replicas under the load bound: at most LOAD_BOUND times the mean of
open sessions (counting this one), rounded up (consistent hashing with bounded loads). So
new work is balanced and only conversations already placed stay put; a history shorter than
a block, or none under the bound, goes to the least loaded. A replica whose KV budget is
full refuses the session, which then goes on to another (orchestrator/remote.py). What it
sent where is kept least recently used first, `REMEMBERED_BLOCKS` keys a pool.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Sequence

from tandem.prefix import BLOCK_TOKENS

REMEMBERED_BLOCKS = 65536
LOAD_BOUND = 1.25


def block_keys(token_ids: Sequence[int]) -> list[bytes]:
    """One key per whole block of `token_ids`: a digest of every token up to the block's end."""
    keys, digest = [], b""
    for end in range(BLOCK_TOKENS, len(token_ids) + 1, BLOCK_TOKENS):
        block = ",".join(map(str, token_ids[end - BLOCK_TOKENS:end])).encode()
        digest = hashlib.blake2b(digest + block, digest_size=16).digest()
        keys.append(digest)
    return keys


def rendezvous(key: bytes, addresses: Sequence[str]) -> list[str]:
    """`addresses` from the highest score for `key` to the lowest (highest random weight)."""
    return sorted(addresses, key=lambda a: hashlib.blake2b(key + a.encode(), digest_size=8).digest(),
                  reverse=True)


class PrefixRoutes:
    """Where this orchestrator sent each prefix last, least recently used first out."""

    def __init__(self, capacity: int = REMEMBERED_BLOCKS) -> None:
        self.capacity = capacity
        self._where: OrderedDict[bytes, str] = OrderedDict()
        self._ends: OrderedDict[bytes, str] = OrderedDict()  # each session's last key

    def holder(self, keys: Sequence[bytes], among: Sequence[str]) -> str | None:
        """The replica among `among` sent the longest prefix named by `keys` (None: none)."""
        return _longest(self._where, keys, among)

    def continued(self, keys: Sequence[bytes], among: Sequence[str]) -> str | None:
        """The replica among `among` sent the longest earlier session whose whole history
        (to its last block) `keys` continues (None: none)."""
        return _longest(self._ends, keys, among)

    def record(self, keys: Sequence[bytes], address: str) -> None:
        for key in keys:
            self._where[key] = address
            self._where.move_to_end(key)
        for key in keys[:-1]:  # a history that went past an end: that end named a shared prefix
            self._ends.pop(key, None)
        if keys:
            self._ends[keys[-1]] = address
            self._ends.move_to_end(keys[-1])
        for table in (self._where, self._ends):
            while len(table) > self.capacity:
                table.popitem(last=False)

    def forget(self, address: str) -> None:
        """A replica left: what it held is gone with it."""
        for table in (self._where, self._ends):
            for key in [k for k, a in table.items() if a == address]:
                del table[key]


def _longest(table: dict[bytes, str], keys: Sequence[bytes], among: Sequence[str]) -> str | None:
    for key in reversed(keys):
        address = table.get(key)
        if address is not None and address in among:
            return address
    return None


def choose(loads: dict[str, int], keys: Sequence[bytes], routes: PrefixRoutes) -> str:
    """The address a new session with block `keys` goes to, among `loads` (address: open
    sessions); see the module docstring."""
    if keys and (staying := routes.continued(keys, list(loads))) is not None:
        return staying
    bound = math.ceil(LOAD_BOUND * (sum(loads.values()) + 1) / len(loads))
    under = [a for a, load in loads.items() if load < bound]
    if keys and under:
        held = routes.holder(keys, under)
        return held if held is not None else rendezvous(keys[0], under)[0]
    return min(loads, key=lambda a: loads[a])
