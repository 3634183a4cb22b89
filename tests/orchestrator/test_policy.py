"""The speculation-length policy: pure decisions from measured costs (no timing, no servers)."""

from __future__ import annotations

import pytest

from orchestrator.domain import PassLoad
from orchestrator.policy import (
    PROBE_EVERY,
    Acceptance,
    BatchTable,
    CostModel,
    Deployment,
    Ema,
    Speculation,
    expected_tokens,
)


def measured(draft_ms: float, verify: dict[int, float], alpha: float) -> CostModel:
    costs = CostModel()
    costs.draft_ms_per_token.value = draft_ms
    for size, ms in verify.items():
        costs.observe(0, 0, 0.0, ms, ms, size)
    costs.overhead_ms.value = 0.0
    costs.alpha = Acceptance(accepted=alpha, tested=1.0)
    costs.idle_steps = 0  # the passes above were timings, not plain steps of a request
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
    for _ in range(costs.probe_every):
        assert policy.choose(remaining=100) == 0
        policy.observe(0, 0, 0.0, 400.0, 400.0, 1)
    assert policy.choose(remaining=100) == 1


def test_probes_that_keep_finding_drafting_unprofitable_come_ever_less_often() -> None:
    """Each probe catches the draft up on all it missed; on a deployment where drafting does
    not pay (a llama.cpp target whose blocks cost their tokens one by one) the interval
    doubles, and the next request starts from it: the costs are the deployment's."""
    costs = measured(draft_ms=60, verify={n: 400 * n for n in range(1, 6)}, alpha=0.8)
    gaps, plain = [], 0
    for _ in range(3):  # requests
        policy = Speculation("adaptive", 4, costs)
        for _ in range(300):
            k = policy.choose(remaining=1000)
            if k:
                gaps.append(plain)
                plain = 0
                policy.observe(k, 1, 60.0 * k, 800.0, 900.0, 2)
            else:
                plain += 1
                policy.observe(0, 0, 0.0, 400.0, 400.0, 1)
    assert gaps[:5] == [16, 32, 64, 128, 256]
    assert set(gaps[5:]) == {256}
    costs.verify_ms = {n: Ema(value=100.0) for n in range(1, 6)}  # blocks flat now: drafting pays
    policy = Speculation("adaptive", 4, costs)
    assert policy.choose(remaining=1000) > 0 and costs.probe_every == PROBE_EVERY


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
    costs.idle_steps = costs.probe_every
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

    costs = CostModel()
    costs.observe(0, 0, 0.0, 900.0, 950.0, 1, PassLoad(sessions=6, tokens=6, pass_ms=300.0, queue_depth=12))
    assert costs.verify(6) == 300.0 and costs.verify(1) is None
    assert costs.overhead_ms.value == 50.0  # the wait at the replica is not overhead...
    assert costs.sessions_per_pass() == 6 and costs.passes_per_step() == 3.0  # ...but passes


def test_a_long_queue_does_not_make_speculation_look_cheap() -> None:
    """Found in review: with the wait for shared passes filed as overhead (which no k
    changes), a saturated queue made every k look alike and the largest win."""

    costs = loaded(draft_ms=1, passes={t: 1.0 * t for t in (16, 32, 48, 64, 80)}, sessions=16, alpha=0.5)
    assert Speculation("adaptive", 4, costs).choose(remaining=100) == 0
    for _ in range(30):  # a step now waits behind 200 ms of other sessions' passes
        costs.observe(0, 0, 0.0, 216.0, 216.0, 1, PassLoad(16, 16, 16.0, queue_depth=200))
    assert Speculation("adaptive", 4, costs).choose(remaining=100) == 0


def steady(active: int, shared: bool, draft_ms: float = 85.0, curve: dict[int, float] | None = None,
           alpha: float = 0.75) -> CostModel:
    """The deployment's costs with `active` requests running; a target pass of T tokens costs
    `curve` (default 100 + 50 T ms: a CPU, compute-bound) and the draft `draft_ms` a token."""
    costs = CostModel(deployment=Deployment(active, shared))
    costs.draft_ms_per_token.value = draft_ms
    costs.overhead_ms.value = 0.0
    costs.alpha = Acceptance(accepted=alpha, tested=1.0)
    for tokens in range(1, 200):
        costs.verify_ms[tokens] = Ema(value=(curve or {}).get(tokens, 100 + 50.0 * tokens))
    return costs


def test_one_session_is_the_per_step_policys_alone() -> None:
    costs = steady(1, shared=True, draft_ms=5.0, curve={t: 100.0 + t for t in range(1, 200)})
    assert costs.load_limit(0.75, 4) == 4
    assert Speculation("adaptive", 4, costs).choose(remaining=100) == 4


def test_a_compute_bound_target_under_load_drafts_nothing() -> None:
    # B = 8 on 100 + 50 T: one more drafted token per session costs 400 ms of pass for at most
    # 8 x 0.75 tokens, against 500 ms for 8 plain ones.
    costs = steady(8, shared=False)
    assert costs.load_limit(0.75, 4) == 0
    assert Speculation("adaptive", 4, costs).choose(remaining=100) == 0
    assert Speculation("fixed", 4, costs).choose(remaining=100) == 4  # a fixed k is kept


def test_a_flat_target_under_load_keeps_drafting() -> None:
    costs = steady(32, shared=False, draft_ms=5.0, curve={t: 100.0 for t in range(1, 200)})
    assert costs.load_limit(0.75, 4) == 4


def test_k_falls_as_the_batch_grows_on_a_curve_that_bends() -> None:
    # Flat up to 16 tokens a pass, then linear: a GPU-like target that saturates.
    curve = {t: 100.0 * max(1.0, t / 16) for t in range(1, 200)}
    limits = [steady(b, shared=False, draft_ms=5.0, curve=curve, alpha=0.8).load_limit(0.8, 4)
              for b in (2, 4, 8, 16, 32)]
    assert limits == sorted(limits, reverse=True)
    assert limits[0] == 4 and limits[-1] == 0


@pytest.mark.parametrize("shared", [True, False])
def test_the_drafts_time_counts_wherever_the_draft_runs(shared: bool) -> None:
    """Found by the load sweep with the draft on cores of its own (float32 target, 8 clients):
    the rule took such a draft as free, drafted k_max, and the sessions spent their steps at
    a saturated draft while the target ran passes of 2-3 of 8 sessions. B = 2 on a flattish
    target (200 + 10 T): a draft at 85 ms a token is worth a short block, not k_max, wherever
    it runs (the sessions wait for it before they meet in the target's pass); one at 5 ms is
    worth k_max."""
    costs = steady(2, shared=shared, curve={t: 200 + 10.0 * t for t in range(1, 200)})
    assert 0 < costs.load_limit(0.75, 4) < 4
    costs.draft_ms_per_token.value = 5.0
    assert costs.load_limit(0.75, 4) == 4


def test_the_replicas_fuller_passes_count_as_load() -> None:
    costs = steady(1, shared=False)
    assert costs.load_limit(0.75, 4) == 4  # one request here ...
    costs.batch_sessions.value = 8.0  # ... but passes of 8 at the target: other orchestrators
    assert costs.sessions_sharing() == 8 and costs.load_limit(0.75, 4) == 0


def test_an_unmeasured_pass_is_assumed_to_cost_the_nearest_smaller_one() -> None:
    costs = CostModel(deployment=Deployment(4, False))
    costs.alpha = Acceptance(accepted=0.75, tested=1.0)
    assert costs.load_limit(0.75, 4) == 4  # nothing measured: draft, and measure
    costs.verify_ms[4] = Ema(value=300.0)
    assert costs.load_limit(0.75, 4) == 4  # v(8..20) taken as v(4): optimism, tried then measured
    for tokens in (8, 12, 16, 20):
        costs.verify_ms[tokens] = Ema(value=75.0 * tokens)
    assert costs.load_limit(0.75, 4) == 0


def test_a_batch_table_overrides_the_derived_rule_where_it_covers_the_load() -> None:
    table = BatchTable.parse("1-4:4, 5-16:2, 33-:0", max_k=16)
    assert table is not None
    assert [table.k(b) for b in (1, 4, 5, 16, 17, 32, 33, 1000)] == [4, 4, 2, 2, None, None, 0, 0]
    costs = steady(8, shared=False)  # derived: 0 at 8 (see above)
    costs.deployment.by_batch = table
    assert costs.load_limit(0.75, 4) == 2 and costs.load_limit(0.75, 1) == 1
    costs.deployment.active = 20  # not in the table: derived
    assert costs.load_limit(0.75, 4) == 0
    costs.deployment.active = 40
    assert Speculation("adaptive", 4, costs).choose(remaining=100) == 0


@pytest.mark.parametrize("text, problem", [
    ("1-4", "is not FIRST-LAST:K"), ("a:1", "is not FIRST-LAST:K"), ("0-4:2", "sessions run from 1"),
    ("4-2:1", "sessions run from 1"), ("1-8:2,5-9:1", "overlaps or precedes"),
    ("1-:2,5:1", "overlaps or precedes"), ("1-4:20", "exceeds --max-speculative-tokens 16")])
def test_a_bad_batch_table_is_refused_naming_the_entry(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        BatchTable.parse(text, max_k=16)
    assert BatchTable.parse(" ", max_k=16) is None


def test_every_proposer_has_its_own_costs_over_one_deployment() -> None:
    costs = steady(2, shared=True)
    other = costs.for_proposer()
    assert other.deployment is costs.deployment and other.verify_ms is costs.verify_ms
    assert other.draft_ms_per_token is not costs.draft_ms_per_token


def test_a_draft_taking_turns_on_the_targets_cores_drafts_nothing_under_load() -> None:
    """Found in the load sweep (2 cores, float32 target on oneDNN, the llama.cpp draft): at 2
    clients the rule as if every block rode in one pass drafted, the two sessions fell into
    turns (one drafting, one verifying, 1.0 sessions a pass) and gave 0.81x batched k=0."""
    curve = {1: 452, 2: 530, 3: 579, 4: 620, 5: 663, 6: 700, 9: 803, 10: 856}
    costs = steady(2, shared=True, draft_ms=50.0, curve={t: curve.get(t, 452 + 45.0 * t) for t in range(1, 200)},
                   alpha=0.8)
    costs.deployment.overlap = False  # --overlap auto beside the target: turns
    assert costs.load_limit(0.8, 4) == 0
    costs.deployment.overlap = True  # drafting ahead: every block in one pass, the draft's time charged
    assert costs.load_limit(0.8, 4) > 0
    limit = costs.load_limit(0.8, 4)
    costs.deployment.draft_shares_target = False  # a draft of its own: the sessions meet in one pass
    assert costs.load_limit(0.8, 4) == limit
