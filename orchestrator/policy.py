"""How many tokens to draft per step (k): fixed, or adaptive from measured costs.

The adaptive policy in three sentences:
1. Each step drafts the k in [0, k_max] that maximises the tokens it yields per millisecond,
   E(k) / (k t_draft + v(B(k + 1)) + overhead), from this request's acceptance and the costs
   measured on this deployment (v(T): a target pass of T tokens, B: sessions per pass).
2. While B >= 2 sessions share the target's pass, k is at most the largest k that still
   raises the tokens the hardware yields per millisecond (`load_limit`: every session's
   block in one pass of B(k + 1) tokens, or, for a draft taking turns on the target's
   hardware, each session's draft and pass on their own), or what `--speculation-by-batch`
   says for B.
3. A request that sets num_speculative_tokens, or `--speculation-policy fixed`, gets its k.

With acceptance rate alpha a step of k drafted tokens yields, in expectation (Leviathan et
al. 2023), E(k) = (1 - alpha^(k+1)) / (1 - alpha). alpha is the request's own acceptance so
far, shrunk towards the deployment's running average. A draft that sat out earlier steps
first catches up on the history it missed (lag tokens at t_fed each), once, so that cost is
spread over the drafting steps left (remaining / E(k) of them). A step that queues behind Q
other sessions at the replica waits through Q / B more passes, which grow with k too.

Replicas report with every step the pass that served it (its sessions, tokens and time), so
v(T) is the curve the hardware shows now: nearly flat up to hundreds of tokens on a GPU
(memory-bound), rising on a CPU. A size not yet measured is assumed to cost what the nearest
smaller measured pass does (optimism), so it gets tried and then measured; replicas also time
a few sizes at start-up (`seed_verify`).

Whatever k is chosen, the output is exact: the policy changes speed, never tokens.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from orchestrator.domain import PassLoad

POLICIES = ("adaptive", "fixed")


@dataclass
class Ema:
    """Exponential moving average; `None` until the first sample."""

    weight: float = 0.1
    value: float | None = None

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else self.value + self.weight * (sample - self.value)


@dataclass
class Ratio:
    """Tokens free proposals kept over tokens their estimates expected, with `prior` tokens'
    worth of 1.0 that the evidence never outweighs for good: every decode step forgets a
    little of it (`forget`), so a deployment that stopped taking free proposals after a bad
    streak comes back to trying them."""

    prior: float = 8.0
    kept: float = 0.0
    expected: float = 0.0
    keep: float = 0.99  # of the evidence, per decode step

    @property
    def value(self) -> float:
        return (self.kept + self.prior) / (self.expected + self.prior)

    def add(self, kept: float, expected: float) -> None:
        self.kept += kept
        self.expected += expected

    def forget(self) -> None:
        self.kept *= self.keep
        self.expected *= self.keep


@dataclass
class Acceptance:
    """A running acceptance rate: drafted tokens accepted over drafted tokens *tested*.

    A block is checked in order and stops at its first rejection, so the drafts after it
    are never tested; dividing by every drafted token would understate alpha (0.6 for a
    true 0.8 at k=4). Both sums decay exponentially; `None` until the first test.
    """

    weight: float = 0.05
    accepted: float = 0.0
    tested: float = 0.0

    def add(self, accepted: int, tested: int) -> None:
        keep = 1.0 - self.weight if self.tested else 0.0
        self.accepted = keep * self.accepted + (1.0 - keep) * accepted
        self.tested = keep * self.tested + (1.0 - keep) * tested

    @property
    def value(self) -> float | None:
        return self.accepted / self.tested if self.tested else None


def tested_tokens(k: int, accepted: int) -> int:
    """Drafted tokens a step of k tested: the accepted ones and the first rejected one, if any."""
    return accepted + (1 if accepted < k else 0)


def expected_tokens(alpha: float, k: float) -> float:
    """Tokens one step yields in expectation: accepted drafts plus the recovered/bonus token."""
    if alpha >= 1.0:
        return float(k + 1)
    return float((1.0 - alpha ** (k + 1)) / (1.0 - alpha))


@dataclass
class Deployment:
    """What every request's policy shares of the deployment: the requests running now (they
    share the target's passes, whatever their proposer), and whether the draft computes on
    the target's hardware (the orchestrator finds out from the replicas' model info)."""

    active: int = 0
    draft_shares_target: bool = False
    overlap: bool = True  # drafts draft ahead (--overlap, as the orchestrator resolved it)
    by_batch: BatchTable | None = None  # --speculation-by-batch


@dataclass(frozen=True)
class BatchTable:
    """`--speculation-by-batch`: the most k by the sessions sharing the target's pass, as
    ranges of sessions, e.g. "1-4:4,5-16:2,17-:0". Sessions a table leaves out get the
    derived rule (`CostModel.load_limit`)."""

    rows: tuple[tuple[int, int | None, int], ...]  # (first, last or None: no end, k)

    @classmethod
    def parse(cls, text: str, max_k: int) -> BatchTable | None:
        """The table `text` describes ("" : none); ValueError naming the bad entry."""
        rows: list[tuple[int, int | None, int]] = []
        for entry in (e.strip() for e in text.split(",") if e.strip()):
            match = re.fullmatch(r"(\d+)(?:-(\d*))?:(\d+)", entry)
            if match is None:
                raise ValueError(f"--speculation-by-batch entry {entry!r} is not FIRST-LAST:K, "
                                 f"FIRST-:K or N:K (e.g. \"1-4:4,5-16:2,17-:0\")")
            first, last_text, k = int(match[1]), match[2], int(match[3])
            last = first if last_text is None else (int(last_text) if last_text else None)
            if first < 1 or (last is not None and last < first):
                raise ValueError(f"--speculation-by-batch entry {entry!r}: sessions run from 1 up")
            if rows and (rows[-1][1] is None or first <= rows[-1][1]):
                raise ValueError(f"--speculation-by-batch entry {entry!r} overlaps or precedes the "
                                 f"one before it: give the ranges in increasing order")
            if k > max_k:
                raise ValueError(f"--speculation-by-batch entry {entry!r}: k {k} exceeds "
                                 f"--max-speculative-tokens {max_k}")
            rows.append((first, last, k))
        return cls(tuple(rows)) if rows else None

    def k(self, sessions: int) -> int | None:
        """The table's k for this many sessions; None where it says nothing."""
        for first, last, k in self.rows:
            if first <= sessions and (last is None or sessions <= last):
                return k
        return None


#: Steps decoded plain before the policy drafts one token to measure the draft again, and the
#: most that grows to while probes keep finding drafting unprofitable.
PROBE_EVERY, PROBE_MAX = 16, 256


@dataclass
class CostModel:
    """Running costs of this deployment, shared by all requests of one orchestrator."""

    draft_ms_per_token: Ema = field(default_factory=Ema)
    # What the draft spends per history token it takes in beyond the one of a step in step:
    # its catch-up after steps it sat out (plain steps, or a prefill it was not part of).
    draft_ms_per_fed_token: Ema = field(default_factory=Ema)
    verify_ms: dict[int, Ema] = field(default_factory=dict)  # v(T): a target pass by its tokens T
    overhead_ms: Ema = field(default_factory=Ema)  # per step, outside both forwards
    alpha: Acceptance = field(default_factory=Acceptance)
    # Free (suffix) proposals: tokens kept over tokens their estimates expected.
    free_ratio: Ratio = field(default_factory=lambda: Ratio())
    # Sessions per target pass (1 until a replica reports sharing), and passes queued behind
    # one at the replica; shared like verify_ms.
    batch_sessions: Ema = field(default_factory=lambda: Ema(weight=0.2))
    queue_depth: Ema = field(default_factory=lambda: Ema(weight=0.2))
    deployment: Deployment = field(default_factory=Deployment)  # shared by every proposer
    # Probing: after `probe_every` steps decoded plain (over every request), one step drafts a
    # token to measure the draft again. A probe after which the policy still chooses k = 0
    # doubles the interval (up to PROBE_MAX: each probe catches the draft up on all it missed);
    # a step that drafts by choice brings it back to PROBE_EVERY.
    idle_steps: int = 0
    probe_every: int = PROBE_EVERY
    probing: bool = False

    def verify(self, tokens: int) -> float | None:
        """v(tokens), or the nearest smaller measured pass (optimism); None: nothing that small."""
        known = self.verify_ms.get(tokens)
        if known is not None and known.value is not None:
            return known.value
        smaller = [t for t, ema in self.verify_ms.items() if t < tokens and ema.value is not None]
        return self.verify_ms[max(smaller)].value if smaller else None

    def seed_verify(self, pass_ms: Sequence[tuple[int, float]]) -> None:
        """Start v(T) from passes a replica timed at start-up; live passes then move it."""
        for tokens, ms in pass_ms:
            self.verify_ms.setdefault(tokens, Ema(value=ms))

    def sessions_per_pass(self) -> int:
        return max(1, round(self.batch_sessions.value or 1.0))

    def passes_per_step(self) -> float:
        """Target passes a step waits through: its own, and those of the sessions queued ahead
        of it, N to a pass. They hold everyone's blocks, so they too grow with k."""
        return 1.0 + (self.queue_depth.value or 0.0) / self.sessions_per_pass()

    def for_proposer(self) -> CostModel:
        """A cost model for another proposer: its own draft cost and acceptance, but this
        deployment's target, so the same verify, load and overhead measurements."""
        return CostModel(verify_ms=self.verify_ms, overhead_ms=self.overhead_ms,
                         batch_sessions=self.batch_sessions, queue_depth=self.queue_depth,
                         deployment=self.deployment)

    def sessions_sharing(self) -> int:
        """Sessions that share the target's passes: the requests running here, or more where
        the replicas report fuller passes (other orchestrators use them too)."""
        return max(1, self.deployment.active, self.sessions_per_pass())

    def load_limit(self, alpha: float, cap: int) -> int:
        """The most k worth drafting (at most `cap`) while B sessions share the target's pass.

        `--speculation-by-batch` says it where it covers B. Otherwise, with B >= 2, k rises
        from 0 while one more drafted token per session raises the tokens the hardware
        yields per millisecond, and stops at the first that does not. Plain, the B sessions
        share one pass: B / v(B). Drafting k, the sessions draft their blocks (k t_draft, the
        draft's time a token at this load) and meet in one pass of B(k + 1) tokens:
        B E(k) / (k t_draft + v(B(k + 1))). The draft's time counts wherever it runs: on the
        target's hardware it takes the target's cycles; on hardware of its own the sessions
        wait for it before they meet in the target's pass (whose scheduler waits for them where
        that saves a pass, tandem/batching.py `awaited`). A draft that takes turns with the
        target on its hardware (no drafting ahead) has the sessions, each either drafting or
        verifying, no longer meet in one pass: E(k) / (v(k + 1) + k t_draft) for each.
        On a flat v and a fast draft (a GPU below its compute-bound knee) the limit stays at
        k_max; on a CPU under load it falls to 0. With one session the per-step cost alone
        decides."""
        sessions = self.sessions_sharing()
        table = self.deployment.by_batch.k(sessions) if self.deployment.by_batch else None
        if table is not None:
            return min(cap, table)
        t_one = self.verify(sessions)
        if sessions < 2 or t_one is None:
            return cap
        turns = self.deployment.draft_shares_target and not self.deployment.overlap
        t_draft = self.draft_ms_per_token.value or 0.0

        def rate(k: int) -> float:
            per_pass = 1 if turns and k else sessions
            return per_pass * expected_tokens(alpha, k) / (
                (self.verify(per_pass * (k + 1)) or t_one) + k * t_draft)

        k = 0
        while k < cap and rate(k + 1) > rate(k):
            k += 1
        return k

    def observe(self, k: int, accepted: int, draft_ms: float, verify_ms: float, step_ms: float,
                verify_tokens: int, load: PassLoad | None = None, fed: int = 1) -> None:
        """A decode step: its k and acceptance, stage times, the tokens it sent the target,
        and the target's pass that served it (None: a replica that does not report it, taken
        as a pass of this step alone, as long as compute_ms); `fed`: the history tokens the
        draft took in with its block (1 in step; more: a catch-up)."""
        self.idle_steps = 0 if k else self.idle_steps + 1
        self.free_ratio.forget()
        if k > 0:
            t_draft = self.draft_ms_per_token.value
            if fed <= 2:  # in step (2: the draft sat out one step; too little to tell apart)
                self.draft_ms_per_token.add(draft_ms / k)
            elif t_draft is not None:  # a catch-up: what the block cost beyond its k tokens
                self.draft_ms_per_fed_token.add(max(0.0, draft_ms - k * t_draft) / (fed - 1))
            self.alpha.add(accepted, tested_tokens(k, accepted))
        sessions, tokens, pass_ms, queued = (load.sessions, load.tokens, load.pass_ms, load.queue_depth) \
            if load is not None else (1, verify_tokens, verify_ms, 0)
        self.verify_ms.setdefault(tokens, Ema()).add(pass_ms)
        self.batch_sessions.add(sessions)
        self.queue_depth.add(queued)
        # verify_ms is the step's time at the replica, its wait for passes included: the wait
        # is costed through passes_per_step (it grows with k), not as overhead.
        self.overhead_ms.add(max(0.0, step_ms - draft_ms - verify_ms))


@dataclass
class Speculation:
    """The policy of one request: `choose()` before each step, `observe()` after it."""

    policy: str
    max_k: int
    costs: CostModel
    prior_weight: float = 8.0  # tested tokens' worth of trust in the deployment-wide alpha
    tested: int = 0  # drafted tokens tested (see Acceptance)
    accepted: int = 0
    free_expected: float = 0.0  # free proposals' expected kept tokens, summed
    free_kept: int = 0  # and what they kept

    def alpha(self) -> float:
        prior = self.costs.alpha.value if self.costs.alpha.value is not None else 0.7
        return (self.accepted + prior * self.prior_weight) / (self.tested + self.prior_weight)

    def choose(self, remaining: int, prefill: bool = False, lag: int = 1) -> int:
        """k for the next step (a prefill: the k the draft prefills for); never drafts past
        what can still be committed. `lag`: the history tokens the draft would take in first."""
        cap = max(0, min(self.max_k, remaining - 1))
        if self.policy == "fixed" or cap == 0:
            return cap
        cap = self.costs.load_limit(self.alpha(), cap)
        return self._per_step(cap, 0 if prefill else lag, remaining) if cap else 0

    def plain_run(self, remaining: int) -> int:
        """Tokens the target decodes alone, in one run, once the policy has chosen k = 0 after
        the prefill: until its next probe would draft again, and no further than the end."""
        costs = self.costs
        return max(1, min(remaining, costs.probe_every - costs.idle_steps % costs.probe_every))

    def _per_step(self, cap: int, lag: int = 1, remaining: int = 1) -> int:
        """The k that maximises tokens per unit of time (at most `cap`): this step's, and for a
        draft that lags, its catch-up spread over the drafting steps left."""
        t_draft = self.costs.draft_ms_per_token.value
        if t_draft is None:
            return cap  # nothing measured yet: speculate, and learn
        t_one = self.costs.verify(self.costs.sessions_per_pass())
        if t_one is None:
            return 0  # only bigger passes were measured: learn what a plain step costs, once

        def best(catch_up_ms: float) -> int:
            best_k, best_rate = 0, 0.0
            for k in range(cap + 1):
                rate = self._rate(k, t_draft, t_one, catch_up_ms, remaining)
                if rate > best_rate:
                    best_k, best_rate = k, rate
            return best_k

        catch_up = max(0, lag - 1) * (self.costs.draft_ms_per_fed_token.value or 0.0)
        best_k = best(catch_up)
        costs = self.costs
        if costs.probing and best_k == 0:  # the probe measured drafting unprofitable again
            costs.probe_every = min(PROBE_MAX, 2 * costs.probe_every)
        costs.probing = False
        if best_k > 0:
            costs.probe_every = PROBE_EVERY
        # Speculation looked unprofitable for a while: check whether it still is, unless only
        # the catch-up stands in its way (too few tokens left to earn it back: nothing to learn).
        if best_k == 0 and costs.idle_steps >= costs.probe_every and (not catch_up or best(0.0) == 0):
            costs.probing = True
            return 1
        return best_k

    def _rate(self, k: int, t_draft: float, t_one: float, catch_up_ms: float, remaining: int,
              expected: float | None = None) -> float:
        """Tokens per millisecond of a step drafting k tokens at t_draft each (`expected`: the
        tokens it yields, else E(k) at this request's acceptance): each session's block in one
        pass of the sessions' blocks, through the passes queued ahead, and the draft's
        catch-up, once, a share of it for each of the remaining / E(k) steps."""
        sessions, passes = self.costs.sessions_per_pass(), self.costs.passes_per_step()
        tokens = expected_tokens(self.alpha(), k) if expected is None else expected
        cost = k * t_draft + passes * (self.costs.verify(sessions * (k + 1)) or t_one) + (
            self.costs.overhead_ms.value or 0.0)
        if k:
            cost += catch_up_ms * tokens / remaining
        return tokens / cost

    def free_ratio(self) -> float:
        """Tokens free proposals had kept per token their estimates expected: this request's,
        shrunk towards the deployment's running ratio (1 until measured)."""
        prior = self.costs.free_ratio.value
        return (self.free_kept + prior * self.prior_weight) / (self.free_expected + self.prior_weight)

    def free_length(self, probabilities: Sequence[float], k: int, lag: int, remaining: int) -> int:
        """How many tokens of a free proposal to verify (0: none): the length whose expected
        yield per millisecond is highest, if it beats this step's k of the model (k = 0: the
        target alone). Its tokens' estimated probabilities are scaled by `free_ratio`, and
        its cost is the target's pass alone; nothing measured yet: all of it, to learn."""
        t_one = self.costs.verify(self.costs.sessions_per_pass())
        if t_one is None:
            return len(probabilities)
        t_draft = self.costs.draft_ms_per_token.value or 0.0
        catch_up = max(0, lag - 1) * (self.costs.draft_ms_per_fed_token.value or 0.0)
        best, best_rate = 0, self._rate(k, t_draft, t_one, catch_up, remaining)
        ratio, kept = self.free_ratio(), 0.0
        for n, probability in enumerate(probabilities, 1):
            kept += ratio * probability
            rate = self._rate(n, 0.0, t_one, 0.0, remaining, expected=1.0 + kept)
            if rate > best_rate:
                best, best_rate = n, rate
        return best

    def observe_free(self, expected: float, kept: int) -> None:
        """A free proposal expected to keep `expected` tokens kept `kept`."""
        self.free_expected += expected
        self.free_kept += kept
        self.costs.free_ratio.add(kept, expected)

    def observe(self, k: int, accepted: int, draft_ms: float, verify_ms: float, step_ms: float,
                verify_tokens: int, load: PassLoad | None = None, fed: int = 1) -> None:
        """Record a decode step (not a prefill) of k drafted tokens, verify_tokens scored in one
        pass, the draft having taken in `fed` history tokens first."""
        self.tested += tested_tokens(k, accepted)
        self.accepted += accepted
        self.costs.observe(k, accepted, draft_ms, verify_ms, step_ms, verify_tokens, load, fed)
