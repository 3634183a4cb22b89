"""How many tokens to draft per step (k): fixed, or adaptive from measured costs.

Speculation pays only when the tokens a step yields outweigh what it costs. With
acceptance rate alpha, a step that drafts k tokens yields, in expectation (Leviathan
et al. 2023),

    E(k) = (1 - alpha^(k+1)) / (1 - alpha)

tokens and costs k * t_draft + t_verify(k + 1) + t_overhead, plus, where the draft sat
out earlier steps, its catch-up on the history it missed (lag tokens at t_fed each), once,
so spread over the drafting steps left: remaining / E(k) of them. The adaptive policy picks
the k in [0, k_max] that maximises E(k) / cost(k), with alpha from the request's own
acceptance so far (shrunk towards the deployment's running average) and the costs
measured on this deployment's replicas.

The target's cost is a curve v(T): the time of one forward pass over T tokens, which
replicas report with every step (the pass that served it, its sessions and tokens, since
passes are shared by every session that is ready). On a GPU v is nearly flat up to
hundreds of tokens (memory-bound); on a CPU it is not; under load every pass holds N
sessions. So a step of k drafted tokens is costed as one pass of N * (k + 1) tokens, the
fleet's view: if every session in the pass drafts k, that is what the pass holds; and a
step that queues behind Q others waits through Q / N more such passes. While v
is flat, speculation is nearly free and k stays high; as load makes the target
compute-bound (v grows with T), the extra tokens crowd out other sessions' real tokens
and k falls towards 0; it rises again as load drops. A size not yet measured is assumed
to cost what the nearest smaller measured pass does (optimism), so it gets tried and then
measured.

Whatever k is chosen, the output is exact: the policy changes speed, never tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from orchestrator.domain import PassLoad

POLICIES = ("adaptive", "fixed")

log = logging.getLogger(__name__)


@dataclass
class Ema:
    """Exponential moving average; `None` until the first sample."""

    weight: float = 0.1
    value: float | None = None

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else self.value + self.weight * (sample - self.value)


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


def load_bucket(active: int) -> int:
    """Loads within a factor of two share their measurements: 2-3 -> 2, 4-7 -> 4, ..."""
    return 1 << (max(active, 1).bit_length() - 1)


@dataclass
class Fleet:
    """Whether drafting pays for the whole fleet, by what each committed token costs the hardware.

    Under concurrent load the per-step cost model misses what sessions do to each other: a
    session at the draft is not in the target's next pass, so speculation thins the passes it
    is costed against, and a draft on the target's hardware takes the target's cycles. While
    two or more requests run, the hardware is busy, and what the fleet yields is tokens per
    unit of it. So each decode step is charged the hardware time it used: its share of the
    target pass that served it (the pass's time x the step's tokens / the pass's tokens), plus
    the draft's compute for it where the draft shares the target's hardware. Per load (within
    a factor of two) and regime (k = 0, or drafting), the ms per committed token is a running
    average. Steps decode plain (k = 0) while that is the cheaper; a plain token not measured
    at this load is costed v(N) / N (N requests in one pass; v: the target's measured passes,
    nearest smaller size). With one request the per-step policy alone decides. Output never
    changes. A change of regime at a load is logged.

    Measuring drafting is exploration, paid for in hardware time: `min_steps` steps draft
    while the rest decode plain, and the first of them catches the draft up on its whole
    history. So measuring spends at most `explore` of the hardware time charged at that load:
    a round of measuring starts only once that share covers it (what a measuring step costs is
    learnt from the first ones, which are free). Drafting is not measured at a load where plain
    already won at a lighter one (more load only favours it more). A drafting figure older than
    `keep_s` is measured again when the share allows; until then it still decides.

    NOTE: a draft pass shared by several sessions is charged in full to each (the draft's
    reply does not say how many shared it), so drafting is overcharged where draft passes
    batch; and with --overlap on beside the target, drafting ahead is not charged at all.
    """

    deployment: Deployment = field(default_factory=Deployment)
    enabled: bool = True
    keep_s: float = 60.0
    explore: float = 0.03  # the most of a load's hardware time spent measuring drafting there
    min_steps: int = 2  # drafting steps measured at a load before plain may win there
    clock: Callable[[], float] = time.monotonic
    # (load bucket, plain) -> (ms per committed token, steps measured, when last measured)
    cost_per_token: dict[tuple[int, bool], tuple[Ema, int, float]] = field(default_factory=dict)
    # Drafting steps let through at a load whose drafting is not measured yet: min_steps of
    # them measure it; the rest decode plain meanwhile (32 requests starting at once would
    # otherwise all draft, each draft catching up on its prompt, before a figure is in).
    measuring: dict[int, tuple[int, float]] = field(default_factory=dict)  # bucket -> (steps, since)
    # bucket -> [hardware ms charged there, of which measuring drafting]
    spent_ms: dict[int, list[float]] = field(default_factory=dict)
    measuring_step_ms: Ema = field(default_factory=lambda: Ema(weight=0.3))  # what one measuring step cost
    _logged: dict[int, bool] = field(default_factory=dict)  # the last decision logged, by load

    def charge(self, k: int, committed: int, draft_ms: float, target_ms: float) -> None:
        """A decode step of k drafted tokens committed `committed`, costing target_ms of the
        target's pass and draft_ms at the draft."""
        if self.deployment.active < 2 or committed < 1:
            return
        bucket = load_bucket(self.deployment.active)
        key = (bucket, k == 0)
        ema, steps, _ = self.cost_per_token.get(key) or (Ema(weight=0.2), 0, 0.0)
        spent = target_ms + (draft_ms if k and self.deployment.draft_shares_target else 0.0)
        ema.add(spent / committed)
        self.cost_per_token[key] = (ema, steps + 1, self.clock())
        total = self.spent_ms.setdefault(bucket, [0.0, 0.0])
        total[0] += spent
        if k and steps < self.min_steps:  # a step measuring drafting here
            total[1] += spent
            self.measuring_step_ms.add(spent)

    def _measured(self, bucket: int, plain: bool) -> tuple[float, int, bool] | None:
        """(ms per token, steps, fresh); a stale plain figure is dropped (v(N) / N stands in)."""
        known = self.cost_per_token.get((bucket, plain))
        if known is None or known[0].value is None:
            return None
        fresh = self.clock() - known[2] <= self.keep_s
        if plain and not fresh:
            del self.cost_per_token[(bucket, plain)]
            return None
        return known[0].value, known[1], fresh

    def _plain_below(self, bucket: int) -> bool:
        """Whether plain decoding measured cheaper, and recently, at a lighter load (2+)."""
        for lighter in (1 << i for i in range(1, bucket.bit_length() - 1)):  # 2, 4, ... < bucket
            drafting, plain = self._measured(lighter, plain=False), self._measured(lighter, plain=True)
            if drafting is not None and plain is not None and drafting[2] \
                    and drafting[1] >= self.min_steps and plain[0] < drafting[0]:
                return True
        return False

    def _affordable(self, bucket: int) -> bool:
        """Whether `explore` of the hardware time charged at this load covers a round of measuring."""
        step = self.measuring_step_ms.value
        if step is None:
            return True  # nothing measured anywhere yet: learn what measuring costs
        total, measuring = self.spent_ms.get(bucket, (0.0, 0.0))
        return measuring + self.min_steps * step <= self.explore * total

    def _measure(self, bucket: int) -> bool:
        """Whether this step takes a place measuring drafting at this load."""
        granted, since = self.measuring.get(bucket, (0, self.clock()))
        if self.clock() - since > self.keep_s:  # the last round is over, or never came in: again
            granted, since = 0, self.clock()
        if granted >= self.min_steps or (granted == 0 and not self._affordable(bucket)):
            return False
        if granted == 0:
            self.cost_per_token.pop((bucket, False), None)  # a new round, from scratch
        self.measuring[bucket] = (granted + 1, since)
        return True

    def plain(self, verify: Callable[[int], float | None], decode: bool = True) -> bool:
        """Whether steps now decode without drafting; `verify`: v(T), the target's pass of T
        tokens. Only a decode step (not a prefill, which is never charged) may measure drafting."""
        decision, why, figures = self._plain(verify, decode)
        bucket = load_bucket(self.deployment.active)
        if self.deployment.active >= 2 and self._logged.get(bucket) != decision:
            self._logged[bucket] = decision
            log.info("fleet: %d requests running: %s (" + why + ")", self.deployment.active,
                     "decoding plain" if decision else "drafting", *figures)
        return decision

    def _plain(self, verify: Callable[[int], float | None], decode: bool) -> tuple[bool, str, tuple[float, ...]]:
        """The decision, and why: a log format and its arguments."""
        n = self.deployment.active
        if not self.enabled or n < 2:
            return False, "the per-step policy", ()
        bucket = load_bucket(n)
        drafting = self._measured(bucket, plain=False)
        known = drafting is not None and drafting[1] >= self.min_steps
        if not known and self._plain_below(bucket):
            return True, "plain won at a lighter load", ()  # more load only favours it more
        if drafting is None or not known or not drafting[2]:
            # Draft, and measure what it costs at this load (min_steps steps), if its share of
            # the hardware allows; until then a stale figure still decides, and no figure: plain.
            if decode and self._measure(bucket):
                return False, "measuring what drafting costs", ()
            if not decode and not known:
                return False, "a prefill, drafting not measured yet", ()
            if drafting is None or not known:
                if self.measuring.get(bucket, (0, 0.0))[0]:
                    return True, "while drafting is measured", ()
                return True, "measuring drafting here waits for its share of the hardware", ()
        plain = self._measured(bucket, plain=True)
        if plain is None:
            one_pass = verify(n)
            if one_pass is None:
                return True, "no plain pass measured yet", ()  # a plain step measures it
            return (one_pass / n < drafting[0], "%.0f ms a plain token, from v(%d), against %.0f drafting",
                    (one_pass / n, n, drafting[0]))
        return plain[0] < drafting[0], "%.0f ms a plain token against %.0f drafting", (plain[0], drafting[0])


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
    # Sessions per target pass (1 until a replica reports sharing), and passes queued behind
    # one at the replica; shared like verify_ms.
    batch_sessions: Ema = field(default_factory=lambda: Ema(weight=0.2))
    queue_depth: Ema = field(default_factory=lambda: Ema(weight=0.2))
    fleet: Fleet = field(default_factory=Fleet)  # its own costs; the Deployment is shared

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
                         fleet=Fleet(self.fleet.deployment, enabled=self.fleet.enabled,
                                     keep_s=self.fleet.keep_s, explore=self.fleet.explore,
                                     min_steps=self.fleet.min_steps, clock=self.fleet.clock))

    def observe(self, k: int, accepted: int, draft_ms: float, verify_ms: float, step_ms: float,
                verify_tokens: int, load: PassLoad | None = None, fed: int = 1) -> None:
        """A decode step: its k and acceptance, stage times, the tokens it sent the target,
        and the target's pass that served it (None: a replica that does not report it, taken
        as a pass of this step alone, as long as compute_ms); `fed`: the history tokens the
        draft took in with its block (1 in step; more: a catch-up)."""
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
        # This step's share of the pass (a replica that does not report it: the pass was its own).
        self.fleet.charge(k, accepted + 1, draft_ms, pass_ms * verify_tokens / tokens if tokens else pass_ms)
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
    probe_every: int = 16  # after this many steps without drafting, draft one token to re-measure
    tested: int = 0  # drafted tokens tested (see Acceptance)
    accepted: int = 0
    idle_steps: int = 0

    def alpha(self) -> float:
        prior = self.costs.alpha.value if self.costs.alpha.value is not None else 0.7
        return (self.accepted + prior * self.prior_weight) / (self.tested + self.prior_weight)

    def choose(self, remaining: int, prefill: bool = False, lag: int = 1) -> int:
        """k for the next step (a prefill: the k the draft prefills for); never drafts past
        what can still be committed. `lag`: the history tokens the draft would take in first."""
        cap = max(0, min(self.max_k, remaining - 1))
        if self.policy == "fixed" or cap == 0:
            return cap
        k = self._per_step(cap, 0 if prefill else lag, remaining)
        # Only a step that would draft asks the fleet: one that would not must not take a
        # place measuring drafting at this load (it would report plain, and the places stay
        # taken until keep_s passes, every other step held plain meanwhile).
        if k == 0 or self.costs.fleet.plain(self.costs.verify, decode=not prefill):
            return 0
        return k

    def _per_step(self, cap: int, lag: int = 1, remaining: int = 1) -> int:
        """The k that maximises tokens per unit of time (at most `cap`): this step's, and for a
        draft that lags, its catch-up spread over the drafting steps left."""
        t_draft = self.costs.draft_ms_per_token.value
        if t_draft is None:
            return cap  # nothing measured yet: speculate, and learn
        sessions, passes = self.costs.sessions_per_pass(), self.costs.passes_per_step()
        t_one = self.costs.verify(sessions)
        if t_one is None:
            return 0  # only bigger passes were measured: learn what a plain step costs, once
        alpha, overhead = self.alpha(), self.costs.overhead_ms.value or 0.0

        def best(catch_up_ms: float) -> int:
            best_k, best_rate = 0, 0.0
            for k in range(cap + 1):
                cost = k * t_draft + passes * (self.costs.verify(sessions * (k + 1)) or t_one) + overhead
                if k:  # the catch-up, once: a share of it for each of the remaining / E(k) steps
                    cost += catch_up_ms * expected_tokens(alpha, k) / remaining
                rate = expected_tokens(alpha, k) / cost
                if rate > best_rate:
                    best_k, best_rate = k, rate
            return best_k

        catch_up = max(0, lag - 1) * (self.costs.draft_ms_per_fed_token.value or 0.0)
        best_k = best(catch_up)
        # Speculation looked unprofitable for a while: check whether it still is, unless only
        # the catch-up stands in its way (too few tokens left to earn it back: nothing to learn).
        if best_k == 0 and self.idle_steps >= self.probe_every and (not catch_up or best(0.0) == 0):
            return 1
        return best_k

    def observe(self, k: int, accepted: int, draft_ms: float, verify_ms: float, step_ms: float,
                verify_tokens: int, load: PassLoad | None = None, fed: int = 1) -> None:
        """Record a decode step (not a prefill) of k drafted tokens, verify_tokens scored in one
        pass, the draft having taken in `fed` history tokens first."""
        self.tested += tested_tokens(k, accepted)
        self.accepted += accepted
        self.idle_steps = 0 if k else self.idle_steps + 1
        self.costs.observe(k, accepted, draft_ms, verify_ms, step_ms, verify_tokens, load, fed)
