"""The speculation-length policy: pure decisions from measured costs (no timing, no servers)."""

from __future__ import annotations

import pytest

from orchestrator.domain import PassLoad
from orchestrator.policy import (
    Acceptance,
    CostModel,
    Deployment,
    Ema,
    Fleet,
    Speculation,
    expected_tokens,
    load_bucket,
)


def measured(draft_ms: float, verify: dict[int, float], alpha: float) -> CostModel:
    costs = CostModel()
    costs.draft_ms_per_token.value = draft_ms
    for size, ms in verify.items():
        costs.observe(0, 0, 0.0, ms, ms, size)
    costs.overhead_ms.value = 0.0
    costs.alpha = Acceptance(accepted=alpha, tested=1.0)
    return costs


def test_expected_tokens_matches_leviathan() -> None:
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_fixed_policy_is_k_capped_by_what_remains() -> None:
    policy = Speculation("fixed", 4, CostModel())
    assert policy.choose(remaining=100) == 4
    assert policy.choose(remaining=3) == 2
    assert policy.choose(remaining=1) == 0


def test_adaptive_speculates_before_anything_is_measured() -> None:
    assert Speculation("adaptive", 4, CostModel()).choose(remaining=100) == 4


def test_adaptive_drafts_long_blocks_when_verification_is_flat_and_drafts_are_good() -> None:
    costs = measured(draft_ms=10, verify={1: 100, 2: 100, 3: 100, 4: 100, 5: 100}, alpha=0.9)
    assert Speculation("adaptive", 4, costs).choose(remaining=100) == 4


def test_adaptive_falls_to_zero_when_speculation_does_not_pay() -> None:
    # Verification cost grows linearly with the block (a CPU without wide matrix units).
    costs = measured(draft_ms=60, verify={n: 400 * n for n in range(1, 6)}, alpha=0.8)
    assert Speculation("adaptive", 4, costs).choose(remaining=100) == 0


def test_adaptive_uses_the_requests_own_acceptance() -> None:
    costs = measured(draft_ms=30, verify={1: 100, 2: 110, 3: 120, 4: 130, 5: 140}, alpha=0.8)
    policy = Speculation("adaptive", 4, costs)
    assert policy.choose(remaining=100) > 0
    for _ in range(10):  # this request's drafts are always rejected
        policy.observe(4, 0, 120.0, 140.0, 260.0, 5)
    assert policy.choose(remaining=100) == 0


def test_adaptive_probes_after_idle_steps() -> None:
    costs = measured(draft_ms=60, verify={n: 400 * n for n in range(1, 6)}, alpha=0.8)
    policy = Speculation("adaptive", 4, costs)
    for _ in range(policy.probe_every):
        assert policy.choose(remaining=100) == 0
        policy.observe(0, 0, 0.0, 400.0, 400.0, 1)
    assert policy.choose(remaining=100) == 1


def test_a_lagging_draft_drafts_only_where_enough_tokens_remain_to_earn_its_catch_up() -> None:
    """Found in the load sweep on shared cores: the last request of a wave, left alone after
    steps decoded plain, drafted again (one request: the per-step policy decides), and its
    first block first caught the draft up on the whole history for a handful of tokens."""
    costs = measured(draft_ms=40, verify={1: 200, 5: 210}, alpha=0.8)
    costs.draft_ms_per_fed_token.value = 10.0  # a 100-token catch-up: 990 ms
    policy = Speculation("adaptive", 4, costs)
    assert policy.choose(remaining=5, lag=1) > 0  # in step: a block is nearly free
    assert policy.choose(remaining=5, lag=100) == 0  # 990 ms for at most 4 more tokens
    assert policy.choose(remaining=500, lag=100) > 0  # spread over ~150 steps it pays
    assert policy.choose(remaining=5, lag=100, prefill=True) > 0  # a prefill lags nothing yet


def test_no_probe_where_only_the_catch_up_stands_in_the_way() -> None:
    costs = measured(draft_ms=40, verify={1: 200, 5: 210}, alpha=0.8)
    costs.draft_ms_per_fed_token.value = 10.0
    policy = Speculation("adaptive", 4, costs)
    policy.idle_steps = policy.probe_every
    assert policy.choose(remaining=5, lag=100) == 0  # too few tokens left to earn it back
    costs.draft_ms_per_token.value = 400.0  # drafting does not pay even in step: probe it
    assert policy.choose(remaining=5, lag=100) == 1


def test_a_catch_up_is_costed_per_fed_token_apart_from_the_drafts_per_token_cost() -> None:
    costs = CostModel()
    costs.observe(4, 2, 4 * 40 + 99 * 10.0, 300.0, 1500.0, 5, fed=100)
    assert costs.draft_ms_per_token.value is None  # no per-token cost to tell the catch-up from
    assert costs.draft_ms_per_fed_token.value is None
    costs.observe(4, 2, 160.0, 300.0, 500.0, 5, fed=1)
    assert costs.draft_ms_per_token.value == pytest.approx(40.0)
    costs.observe(4, 2, 4 * 40 + 99 * 10.0, 300.0, 1500.0, 5, fed=100)
    assert costs.draft_ms_per_token.value == pytest.approx(40.0)  # untouched by the catch-up
    assert costs.draft_ms_per_fed_token.value == pytest.approx(10.0)


def test_adaptive_measures_a_plain_step_when_only_blocks_were_measured() -> None:
    # Found by the benchmark: a deployment whose requests always drafted never learned what a
    # one-token pass costs, and kept drafting k_max blocks that cost 4x a plain step.
    costs = CostModel()
    costs.draft_ms_per_token.value, costs.alpha = 80.0, Acceptance(accepted=0.5, tested=1.0)
    costs.observe(4, 2, 320.0, 900.0, 1220.0, 5)
    policy = Speculation("adaptive", 4, costs)
    assert policy.choose(remaining=100) == 0  # measure the one-token pass first
    costs.observe(0, 0, 0.0, 240.0, 240.0, 1)
    # Then the measured 5-token block is no longer worth it (sizes 2-4, unmeasured, are
    # assumed to cost one token's pass until tried).
    assert policy.choose(remaining=100) < 4


def test_every_proposer_shares_the_targets_verify_costs() -> None:
    from orchestrator.service import OrchestratorConfig, OrchestratorService

    service = OrchestratorService(OrchestratorConfig(target="127.0.0.1:1"))
    draft, lookup = service.engine.costs["draft-model"], service.engine.costs["prompt-lookup"]
    assert draft.verify_ms is lookup.verify_ms and draft.overhead_ms is lookup.overhead_ms
    assert draft.alpha is not lookup.alpha and draft.draft_ms_per_token is not lookup.draft_ms_per_token


# Steps of k=4 in the exact proportions of a per-token acceptance of 0.8: j accepted, then a
# rejection, with probability 0.8^j * 0.2 (j < 4); all 4 accepted with probability 0.8^4.
ALPHA_08_STEPS = [(0, 2000), (1, 1600), (2, 1280), (3, 1024), (4, 4096)]


def test_alpha_counts_only_the_drafted_tokens_that_were_tested() -> None:
    """Found in review: accepted / drafted reads 0.6 here, since a block stops at its first
    rejection and the drafts after it are never tested."""
    policy = Speculation("adaptive", 4, CostModel(), prior_weight=0.0)
    for accepted, times in ALPHA_08_STEPS:
        for _ in range(times):
            policy.observe(4, accepted, 40.0, 100.0, 140.0, 5)
    assert policy.alpha() == pytest.approx(0.8)


def test_the_deployment_acceptance_is_a_ratio_of_running_sums() -> None:
    rate = Acceptance(weight=0.5)
    assert rate.value is None
    rate.add(4, 4)
    assert rate.value == 1.0
    rate.add(0, 1)
    assert rate.value == pytest.approx(2.0 / 2.5)


def loaded(draft_ms: float, passes: dict[int, float], sessions: int, alpha: float) -> CostModel:
    """Costs measured under load: every target pass held `sessions` sessions' steps."""
    from orchestrator.domain import PassLoad

    costs = CostModel()
    costs.draft_ms_per_token.value = draft_ms
    costs.batch_sessions.value = float(sessions)
    for tokens, ms in passes.items():
        costs.observe(0, 0, 0.0, ms, ms, 1, PassLoad(sessions, tokens, ms, 0))
    costs.overhead_ms.value = 0.0
    costs.alpha = Acceptance(accepted=alpha, tested=1.0)
    return costs


def test_speculation_falls_to_zero_as_load_makes_the_target_compute_bound() -> None:
    # One curve v(T) of the target: flat up to 8 tokens a pass, then linear (compute-bound).
    curve = {t: 100.0 * max(1.0, t / 8) for t in (1, 2, 4, 5, 32, 64, 96, 128, 160)}
    alone = loaded(draft_ms=10, passes={t: curve[t] for t in (1, 2, 4, 5)}, sessions=1, alpha=0.8)
    assert Speculation("adaptive", 4, alone).choose(remaining=100) == 4
    crowded = loaded(draft_ms=10, passes=curve, sessions=32, alpha=0.8)
    assert Speculation("adaptive", 4, crowded).choose(remaining=100) == 0
    # ...and rises again when the load drops.
    crowded.batch_sessions.value = 1.0
    assert Speculation("adaptive", 4, crowded).choose(remaining=100) == 4


def test_a_flat_curve_keeps_speculating_under_load() -> None:
    # A GPU: a pass of 160 tokens costs what a pass of 32 does.
    costs = loaded(draft_ms=5, passes={t: 100.0 for t in (32, 64, 96, 128, 160)}, sessions=32, alpha=0.8)
    assert Speculation("adaptive", 4, costs).choose(remaining=100) == 4


def test_a_step_reports_the_pass_that_served_it_not_its_wait() -> None:
    from orchestrator.domain import PassLoad

    costs = CostModel()
    costs.observe(0, 0, 0.0, 900.0, 950.0, 1, PassLoad(sessions=6, tokens=6, pass_ms=300.0, queue_depth=12))
    assert costs.verify(6) == 300.0 and costs.verify(1) is None
    assert costs.overhead_ms.value == 50.0  # the wait at the replica is not overhead...
    assert costs.sessions_per_pass() == 6 and costs.passes_per_step() == 3.0  # ...but passes


def test_a_long_queue_does_not_make_speculation_look_cheap() -> None:
    """Found in review: with the wait for shared passes filed as overhead (which no k
    changes), a saturated queue made every k look alike and the largest win."""
    from orchestrator.domain import PassLoad

    costs = loaded(draft_ms=1, passes={t: 1.0 * t for t in (16, 32, 48, 64, 80)}, sessions=16, alpha=0.5)
    assert Speculation("adaptive", 4, costs).choose(remaining=100) == 0
    for _ in range(30):  # a step now waits behind 200 ms of other sessions' passes
        costs.observe(0, 0, 0.0, 216.0, 216.0, 1, PassLoad(16, 16, 16.0, queue_depth=200))
    assert Speculation("adaptive", 4, costs).choose(remaining=100) == 0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fleet_costs(active: int, shared: bool, clock: Clock) -> CostModel:
    """The deployment's costs with `active` requests running; a target pass of T tokens costs
    100 + 50 T ms (a CPU: compute-bound), and the draft 85 ms a token."""
    costs = CostModel(fleet=Fleet(Deployment(active, shared), clock=clock))
    costs.draft_ms_per_token.value = 85.0
    costs.overhead_ms.value = 0.0
    costs.alpha = Acceptance(accepted=0.75, tested=1.0)
    return costs


def draft_steps(costs: CostModel, n: int, sessions_per_pass: int) -> None:
    """n steps of k = 4 keeping 2 (3 tokens each), in passes of `sessions_per_pass` such steps."""
    tokens = 5 * sessions_per_pass
    for _ in range(n):
        costs.observe(4, 2, 340.0, 100 + 50.0 * tokens, 400.0, 5, PassLoad(sessions_per_pass, tokens, 100 + 50.0 * tokens, 0))


def plain_steps(costs: CostModel, n: int, sessions_per_pass: int) -> None:
    for _ in range(n):
        ms = 100 + 50.0 * sessions_per_pass
        costs.observe(0, 0, 0.0, ms, ms, 1, PassLoad(sessions_per_pass, sessions_per_pass, ms, 0))


def test_loads_within_a_factor_of_two_share_measurements() -> None:
    assert [load_bucket(n) for n in (1, 2, 3, 4, 7, 8, 31, 32)] == [1, 2, 2, 4, 4, 8, 16, 32]


def test_with_a_draft_on_the_targets_cores_the_fleet_decodes_plain_once_drafting_is_measured() -> None:
    # Two requests taking turns at the target: each drafting step costs 340 ms of draft and a
    # 350 ms pass of its own for 3 tokens (230 ms a token); both plain in one pass, 200 ms for
    # 2 (100 ms a token).
    clock = Clock()
    costs = fleet_costs(2, shared=True, clock=clock)
    assert costs.fleet.min_steps == 2
    assert costs.fleet.plain(costs.verify) is False  # nothing measured at this load: draft, and measure
    draft_steps(costs, 1, sessions_per_pass=1)
    assert costs.fleet.plain(costs.verify) is False  # fewer than min_steps drafting steps
    draft_steps(costs, 1, sessions_per_pass=1)
    assert costs.fleet.plain(costs.verify) is True  # no plain pass of 2 measured: a plain step learns it
    plain_steps(costs, 4, sessions_per_pass=2)
    assert costs.fleet.plain(costs.verify) is True
    assert costs.fleet.cost_per_token[(2, True)][0].value == pytest.approx(100.0)
    assert costs.fleet.cost_per_token[(2, False)][0].value == pytest.approx((340 + 350) / 3)
    assert Speculation("adaptive", 4, costs).choose(remaining=100) == 0
    assert Speculation("fixed", 4, costs).choose(remaining=100) == 4  # a fixed k is kept


@pytest.mark.parametrize("shared", [True, False])
def test_the_drafts_time_counts_only_where_it_shares_the_targets_hardware(shared: bool) -> None:
    # Drafting steps: 340 ms of draft, 350 ms of target for 3 tokens; plain steps alone in their
    # passes: 150 ms a token. Beside the target, a drafted token costs 230 ms of the hardware;
    # on a draft's own, 117 ms of the target's.
    costs = fleet_costs(2, shared=shared, clock=Clock())
    draft_steps(costs, 8, sessions_per_pass=1)
    plain_steps(costs, 8, sessions_per_pass=1)
    assert costs.fleet.plain(costs.verify) is shared


def test_many_requests_in_one_plain_pass_beat_drafting_even_with_a_draft_of_its_own() -> None:
    costs = fleet_costs(32, shared=False, clock=Clock())
    draft_steps(costs, 8, sessions_per_pass=8)  # 8 x 5 tokens: 2100 ms, 262.5 a step, 87.5 a token
    plain_steps(costs, 8, sessions_per_pass=32)  # 1700 ms for 32: 53 a token
    assert costs.fleet.plain(costs.verify) is True


def test_only_a_few_requests_draft_to_measure_a_new_load() -> None:
    # 32 requests start at once: min_steps (2) of them draft to measure drafting; the others
    # decode plain until the figure is in, and again once it says plain is cheaper.
    clock = Clock()
    costs = fleet_costs(32, shared=True, clock=clock)
    # Their prefills measure nothing (a prefill is never charged), so they take no place.
    assert [costs.fleet.plain(costs.verify, decode=False) for _ in range(32)] == [False] * 32
    assert [costs.fleet.plain(costs.verify) for _ in range(32)] == [False] * 2 + [True] * 30
    draft_steps(costs, 2, sessions_per_pass=2)
    plain_steps(costs, 4, sessions_per_pass=30)
    assert costs.fleet.plain(costs.verify) is True
    # Steps let through that never report (cancelled) free their places after keep_s.
    other = fleet_costs(8, shared=True, clock=clock)
    assert [other.fleet.plain(other.verify) for _ in range(3)] == [False] * 2 + [True]
    clock.now += 61.0
    assert other.fleet.plain(other.verify) is False


def test_a_step_the_per_step_policy_would_not_draft_takes_no_measuring_place() -> None:
    """Found in the load sweep: at 4 and 8 clients the places measuring drafting went to steps
    the per-step policy then ran plain, so drafting was never measured there, and every
    other step was held plain "while drafting is measured" until keep_s (60 s) passed."""
    costs = fleet_costs(8, shared=True, clock=Clock())
    costs.batch_sessions.value = 8.0
    for tokens in range(8, 41, 8):  # a compute-bound target: 100 + 50 T ms
        costs.verify_ms[tokens] = Ema()
        costs.verify_ms[tokens].value = 100 + 50.0 * tokens
    assert [Speculation("adaptive", 4, costs).choose(remaining=100) for _ in range(4)] == [0] * 4
    assert 8 not in costs.fleet.measuring
    costs.draft_ms_per_token.value = 5.0  # a cheap draft and a flat target: the per-step policy drafts
    for tokens in range(8, 41, 8):
        costs.verify_ms[tokens].value = 100 + 1.0 * tokens
    ks = [Speculation("adaptive", 4, costs).choose(remaining=100) for _ in range(4)]
    assert all(k > 0 for k in ks[:2]) and ks[2:] == [0, 0]  # two measure; the rest wait plain
    assert costs.fleet.measuring[8][0] == 2


def test_where_plain_won_at_a_lighter_load_a_heavier_one_is_not_measured_again() -> None:
    clock = Clock()
    costs = fleet_costs(2, shared=True, clock=clock)
    draft_steps(costs, 2, sessions_per_pass=1)
    plain_steps(costs, 2, sessions_per_pass=2)
    assert costs.fleet.plain(costs.verify) is True
    costs.fleet.deployment.active = 16  # no measurement at 16: plain, from 2's
    assert costs.fleet.plain(costs.verify) is True and 16 not in costs.fleet.measuring
    clock.now += 61.0  # 2's figures are stale: 16 measures drafting itself, once its share allows
    plain_steps(costs, 1000, sessions_per_pass=16)  # 56 ms each at 16: 3% covers a round (2 x 690 ms)
    assert costs.fleet.plain(costs.verify) is False


def test_where_drafting_won_at_a_lighter_load_a_heavier_one_measures_it_again() -> None:
    costs = fleet_costs(2, shared=False, clock=Clock())
    draft_steps(costs, 2, sessions_per_pass=1)  # 117 ms a token of the target's
    plain_steps(costs, 2, sessions_per_pass=1)  # 150
    assert costs.fleet.plain(costs.verify) is False
    costs.fleet.deployment.active = 8
    assert costs.fleet.plain(costs.verify) is True  # 8 has spent nothing yet to measure with
    plain_steps(costs, 1000, sessions_per_pass=8)  # 62.5 ms each: 3% covers a round (2 x 690 ms)
    assert costs.fleet.plain(costs.verify) is False and costs.fleet.measuring[8][0] == 1


def test_measuring_drafting_spends_at_most_its_share_of_the_hardware_at_a_load() -> None:
    """Found in the load sweep at 4 clients on shared cores: every repeat re-measured drafting
    (its figure was stale after 60 s), and each measuring step caught the draft up on the whole
    history on the target's cores: 0.90x batched k=0. A round of measuring (2 steps) now waits
    until --fleet-explore (3%) of the hardware time charged at that load covers it."""
    clock = Clock()
    costs = fleet_costs(4, shared=True, clock=clock)
    fleet = costs.fleet
    assert [fleet.plain(costs.verify) for _ in range(3)] == [False, False, True]  # the first round is free
    draft_steps(costs, 2, sessions_per_pass=1)  # 690 ms a step: what a measuring step costs
    assert fleet.measuring_step_ms.value == pytest.approx(690.0)
    drafted = 2
    for _ in range(40):  # 40 minutes: stale drafting figures every minute
        clock.now += 61.0
        for _ in range(100):  # 100 steps a minute, each 300 ms / 4 of a plain pass of 4
            if fleet.plain(costs.verify):
                plain_steps(costs, 1, sessions_per_pass=4)
            else:
                draft_steps(costs, 1, sessions_per_pass=1)
                drafted += 1
    total, measuring = fleet.spent_ms[4]
    assert 2 < drafted and measuring == pytest.approx(690.0 * drafted)  # it measured again ...
    assert measuring <= fleet.explore * total + 2 * 690.0  # ... within its share, the free round aside
    assert fleet.plain(costs.verify) is True  # and the stale figure decided meanwhile: plain


def test_a_load_with_no_measured_drafting_and_no_share_yet_decodes_plain() -> None:
    costs = fleet_costs(2, shared=True, clock=Clock())
    draft_steps(costs, 2, sessions_per_pass=1)  # measured at 2: a measuring step's cost is known
    costs.fleet.deployment.active = 4
    assert costs.fleet.plain(costs.verify) is True and 4 not in costs.fleet.measuring
    costs.fleet.explore = 1.0  # all the hardware may go to measuring: 4 measures at once
    plain_steps(costs, 20, sessions_per_pass=4)  # 75 ms each: 1500 ms covers 2 x 690
    assert costs.fleet.plain(costs.verify) is False

def test_an_unmeasured_plain_load_is_costed_from_the_targets_passes() -> None:
    clock = Clock()
    costs = fleet_costs(8, shared=True, clock=clock)
    plain_steps(costs, 2, sessions_per_pass=1)  # v(1) = 150 (measured at another load)
    costs.fleet.cost_per_token.clear()
    draft_steps(costs, 4, sessions_per_pass=2)  # 340 + 550 ms for 3 tokens
    # v(8) is taken as v(1) or the nearest smaller measured pass: 150 / 8 a token. Plain.
    assert costs.fleet.plain(costs.verify) is True


def test_one_request_is_the_per_step_policys_alone() -> None:
    clock = Clock()
    costs = fleet_costs(1, shared=True, clock=clock)
    draft_steps(costs, 8, sessions_per_pass=1)
    plain_steps(costs, 8, sessions_per_pass=1)
    assert costs.fleet.cost_per_token == {}  # nothing charged: one request is not the fleet's
    assert costs.fleet.plain(costs.verify) is False


def test_a_measured_cost_goes_stale_and_drafting_is_measured_again() -> None:
    clock = Clock()
    costs = fleet_costs(4, shared=True, clock=clock)
    draft_steps(costs, 4, sessions_per_pass=1)
    plain_steps(costs, 4, sessions_per_pass=4)
    assert costs.fleet.plain(costs.verify) is True
    clock.now += 30.0
    plain_steps(costs, 4, sessions_per_pass=4)  # plain stays fresh; drafting's figure ages
    assert costs.fleet.plain(costs.verify) is True
    clock.now += 31.0  # 61 s old: it still decides until measuring it again is affordable
    assert costs.fleet.plain(costs.verify) is True and (4, False) in costs.fleet.cost_per_token
    plain_steps(costs, 1200, sessions_per_pass=4)  # 75 ms each: 3% covers the first round and one more
    assert costs.fleet.plain(costs.verify) is False  # draft again, measure again, from scratch
    assert (4, False) not in costs.fleet.cost_per_token

def test_every_proposer_has_its_own_costs_over_one_deployment() -> None:
    costs = fleet_costs(2, shared=True, clock=Clock())
    other = costs.for_proposer()
    assert other.fleet.deployment is costs.fleet.deployment and other.fleet is not costs.fleet
    draft_steps(costs, 4, sessions_per_pass=1)
    assert other.fleet.cost_per_token == {}


def test_the_fleet_can_be_turned_off() -> None:
    clock = Clock()
    costs = fleet_costs(4, shared=True, clock=clock)
    costs.fleet.enabled = False
    draft_steps(costs, 4, sessions_per_pass=1)
    plain_steps(costs, 4, sessions_per_pass=4)
    assert costs.fleet.plain(costs.verify) is False
