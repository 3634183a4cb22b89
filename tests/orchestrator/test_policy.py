"""The speculation-length policy: pure decisions from measured costs (no timing, no servers)."""

from __future__ import annotations

import pytest

from orchestrator.policy import Acceptance, CostModel, FleetRegime, Speculation, expected_tokens


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


def run_fleet(fleet: FleetRegime, clock: Clock, seconds: float, tokens_per_s: dict[bool, float]) -> list[bool]:
    """Every running request commits tokens at the rate of the phase it finds, each 0.1 s;
    returns whether each step decoded plain."""
    seen = []
    for _ in range(int(seconds * 10)):
        plain = fleet.plain()
        seen.append(plain)
        clock.now += 0.1
        for _ in range(fleet.active):
            fleet.record(round(tokens_per_s[plain] * 0.1))
    return seen


@pytest.mark.parametrize("plain_wins", [True, False])
def test_the_fleet_keeps_whichever_regime_commits_more(plain_wins: bool) -> None:
    clock = Clock()
    fleet = FleetRegime(probe_s=2.0, keep_s=20.0, clock=clock)
    for _ in range(8):
        fleet.enter()
    rates = {True: 20.0, False: 10.0} if plain_wins else {True: 10.0, False: 20.0}
    probes = run_fleet(fleet, clock, 4.0, rates)
    assert probes[:20] == [True] * 20 and probes[20:] == [False] * 20  # plain, then the policy
    kept = run_fleet(fleet, clock, 20.0, rates)
    assert set(kept[1:-1]) == {plain_wins}
    assert fleet.rates[("plain" if plain_wins else "policy")] > fleet.rates[("policy" if plain_wins else "plain")]
    assert run_fleet(fleet, clock, 0.2, rates)[-1] is True  # kept long enough: measured again


def test_one_request_is_the_per_step_policys_alone() -> None:
    clock = Clock()
    fleet = FleetRegime(probe_s=1.0, clock=clock)
    fleet.enter()
    assert not any(run_fleet(fleet, clock, 10.0, {True: 10.0, False: 1.0}))
    costs = measured(draft_ms=10, verify={1: 100, 2: 100, 3: 100, 4: 100, 5: 100}, alpha=0.9)
    assert Speculation("adaptive", 4, costs).choose(remaining=100) == 4


def test_a_doubled_load_is_measured_again_at_once() -> None:
    clock = Clock()
    fleet = FleetRegime(probe_s=1.0, keep_s=100.0, clock=clock)
    for _ in range(4):
        fleet.enter()
    run_fleet(fleet, clock, 2.1, {True: 10.0, False: 20.0})
    assert not fleet.plain() and not fleet.probing  # the policy won, kept for 100 s
    for _ in range(4):
        fleet.enter()
    assert fleet.plain() and fleet.probing


def test_under_a_plain_phase_the_adaptive_policy_drafts_nothing_and_a_fixed_k_is_kept() -> None:
    costs = measured(draft_ms=10, verify={1: 100, 2: 100, 3: 100, 4: 100, 5: 100}, alpha=0.9)
    costs.fleet = FleetRegime(probe_s=1.0)
    costs.fleet.enter()
    costs.fleet.enter()
    assert costs.for_proposer().fleet is costs.fleet  # one fleet for every proposer
    assert Speculation("adaptive", 4, costs).choose(remaining=100) == 0  # probing plain first
    assert Speculation("fixed", 4, costs).choose(remaining=100) == 4


def test_the_fleet_regime_is_off_unless_asked_for() -> None:
    fleet = FleetRegime()
    for _ in range(8):
        fleet.enter()
    assert not fleet.plain()
