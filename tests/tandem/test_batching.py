"""Batched passes against plain passes, and the scheduler that forms the batches.

The reference for every session is a plain full pass over its history with the model's own
mask: after random accepted prefixes (rollbacks) across sessions that share passes, each
session's logits must equal it to float rounding (1e-4 in float32; every argmax equal),
with draft blocks, token trees and a sliding window shorter than the text.
"""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from tandem import batching
from tandem.batching import Pass, StepScheduler
from tandem.kv import KVSession, tree_segment

VOCAB = 40
TOLERANCE = 1e-4
SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
         "initializer_range": 0.3}


def served(model: torch.nn.Module) -> torch.nn.Module:
    """The model as a service runs it: batched passes attend one session at a time."""
    batching.use_batched_attention(model)
    return model.eval()


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return served(LlamaForCausalLM(LlamaConfig(**SMALL)))


def mistral() -> torch.nn.Module:
    torch.manual_seed(0)
    return served(MistralForCausalLM(MistralConfig(**SMALL, sliding_window=8)))


def test_the_batched_attention_is_the_served_models_alone() -> None:
    """Importing tandem.batching changes no attention; a served model's batched passes run
    Tandem's, and another model in the same process keeps transformers' sdpa."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    assert AttentionInterface()["sdpa"] is sdpa_attention_forward
    torch.manual_seed(0)
    plain = LlamaForCausalLM(LlamaConfig(**SMALL)).eval()
    ours = llama()
    assert ours.config._attn_implementation == batching.BATCHED_ATTENTION
    assert plain.config._attn_implementation == "sdpa"
    assert AttentionInterface()["sdpa"] is sdpa_attention_forward
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.inference_mode():
        assert torch.equal(plain(input_ids=ids).logits, ours(input_ids=ids).logits)


def full_pass(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0]  # type: ignore[no-any-return]


def reference(model: torch.nn.Module, history: list[int], p: Pass, parents: tuple[int, ...]) -> torch.Tensor:
    """What the pass must return, from plain full passes with the model's own mask: the last
    rows over history + new tokens, then each tree node's row after its path from the root."""
    ids = history + list(p.token_ids)
    rows = [full_pass(model, ids)[-p.logits_to_keep:]]
    for node in range(len(p.segment.token_ids)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        rows.append(full_pass(model, ids + [p.segment.token_ids[j] for j in reversed(path)])[-1:])
    return torch.cat(rows)


@pytest.mark.parametrize("make", [llama, mistral], ids=["llama", "mistral-window-8"])
def test_batched_passes_match_one_cache_per_session(make) -> None:  # type: ignore[no-untyped-def]
    model, rng = make(), random.Random(1)
    sessions = [KVSession(f"s{i}", VOCAB) for i in range(5)]
    histories: list[list[int]] = [[] for _ in sessions]
    window = batching.models.sliding_window(model)
    for round_ in range(20):
        passes, kept, trees = [], [], []
        for session, history in zip(sessions, histories, strict=True):
            # Each session keeps a random prefix of what it holds (a rejection), then adds a
            # block of 1-5 tokens, or a token tree after its new token.
            keep = rng.randint(max(0, len(history) - 4), len(history)) if history else 0
            del history[keep:]
            new = [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 5))]
            if round_ % 3 == 2:
                new = new[:1]
                parents = (-1, 0, 0, 1)
                segment = tree_segment(tuple(rng.randrange(2, VOCAB) for _ in range(4)), parents)
                passes.append(Pass(session, keep, tuple(new), 1, segment))
            else:
                parents = ()
                passes.append(Pass(session, keep, tuple(new), logits_to_keep=len(new)))
            trees.append(parents)
            kept.append(list(history))
            history.extend(new)
        outputs = batching.batched(model, passes, window)
        for p, before, out, parents in zip(passes, kept, outputs, trees, strict=True):
            expected = reference(model, before, p, parents)
            assert out.logits.shape == expected.shape
            assert torch.allclose(out.logits, expected, atol=TOLERANCE), (out.logits - expected).abs().max()
            assert torch.equal(out.logits.argmax(-1), expected.argmax(-1))
            assert p.session.length == len(before) + len(p.token_ids)  # the tree was forgotten


def test_hidden_states_come_back_for_the_sessions_that_ask() -> None:
    model = llama()
    a, b = KVSession("a", VOCAB), KVSession("b", VOCAB)
    segment = tree_segment((5, 6), (-1, 0))
    out_a, out_b = batching.batched(model, [Pass(a, 0, (3, 4), 1, segment, with_hidden=True),
                                            Pass(b, 0, (7, 8, 9))], None)
    alone = batching.single(model, Pass(KVSession("c", VOCAB), 0, (3, 4), 1, segment, with_hidden=True))
    assert out_b.hidden is None and out_a.hidden is not None and alone.hidden is not None
    assert torch.allclose(out_a.hidden, alone.hidden, atol=TOLERANCE)


def start(scheduler: StepScheduler, model: torch.nn.Module) -> None:
    """Start the scheduler on the model's forward, as the model service does: the start-up
    probe decides whether its sessions may share a pass."""
    scheduler.start(batching.TorchRunner(model), batching.batching_refusal(model))


def test_the_scheduler_batches_ready_passes_and_answers_each_its_own() -> None:
    model = llama()
    seen: list[batching.BatchStats] = []
    scheduler = StepScheduler(max_sessions=8, max_tokens=64, on_batch=seen.append)
    start(scheduler, model)

    async def everyone() -> list[list[int]]:
        return list(await asyncio.gather(*(greedy(scheduler, [3 + i, 4, 5 + i], 12) for i in range(6))))

    together = asyncio.run(everyone())
    for i, tokens in enumerate(together):
        alone = asyncio.run(greedy(batching.direct(model), [3 + i, 4, 5 + i], 12))
        assert tokens == alone
    assert max(s.sessions for s in seen) > 1  # passes really shared a forward
    assert sum(s.sessions for s in seen) == 6 * 12


async def greedy(forward: batching.Forward, prompt: list[int], steps: int) -> list[int]:
    """`steps` greedy tokens after `prompt`, on a session of its own, through `forward`."""
    session = KVSession("greedy", VOCAB)
    out = await forward(Pass(session, 0, tuple(prompt)))
    tokens = [int(out.logits[-1].argmax())]
    for _ in range(steps - 1):
        out = await forward(Pass(session, session.length, (tokens[-1],)))
        tokens.append(int(out.logits[-1].argmax()))
    return tokens


def test_the_scheduler_keeps_its_limits() -> None:
    model = llama()
    seen: list[batching.BatchStats] = []
    scheduler = StepScheduler(max_sessions=2, max_tokens=6, on_batch=seen.append)
    start(scheduler, model)

    async def everyone() -> None:
        sessions = [KVSession(f"s{i}", VOCAB) for i in range(5)]
        await asyncio.gather(*(scheduler(Pass(s, 0, (3, 4, 5))) for s in sessions))
        await asyncio.gather(*(scheduler(Pass(s, 0, tuple(range(3, 13)))) for s in sessions[:2]))

    asyncio.run(everyone())
    assert all(s.sessions <= 2 for s in seen)
    assert all(s.tokens <= 6 or s.sessions == 1 for s in seen)  # a long pass runs alone
    assert sum(s.sessions for s in seen) == 7


def test_a_failed_pass_fails_only_its_steps_and_the_scheduler_goes_on() -> None:
    model = llama()
    scheduler = StepScheduler(max_sessions=4, max_tokens=64)
    start(scheduler, model)

    async def run() -> None:
        bad = KVSession("bad", VOCAB)
        with pytest.raises(Exception, match="beyond the session's cache length"):
            await scheduler(Pass(bad, 5, (3,)))
        good = KVSession("good", VOCAB)
        out = await scheduler(Pass(good, 0, (3, 4)))
        assert out.logits.shape == (1, VOCAB)

    asyncio.run(run())


def test_padding_to_a_bucket_changes_no_session_s_logits() -> None:
    model = llama()
    plain = [KVSession(f"p{i}", VOCAB) for i in range(3)]
    padded = [KVSession(f"q{i}", VOCAB) for i in range(3)]
    for step in range(3):
        new = [(3 + step, 4), (5,), (6 + step, 7, 8)]  # 6 tokens: padded to 16
        outs = [batching.batched(model, [Pass(s, s.length, n, len(n)) for s, n in zip(group, new, strict=True)],
                                 None, buckets)
                for group, buckets in ((plain, ()), (padded, (4, 16, 64)))]
        for a, b in zip(*outs, strict=True):
            assert torch.allclose(a.logits, b.logits, atol=TOLERANCE)
    assert [s.length for s in padded] == [s.length for s in plain] == [6, 3, 9]


@pytest.mark.parametrize("spec, device, expected", [
    ("auto", "cpu", ()), ("auto", "cuda:0", ()), ("off", "cuda", ()),
    ("32,8,16", "cpu", (8, 16, 32)),
])
def test_bucket_flags(spec: str, device: str, expected: tuple[int, ...]) -> None:
    assert batching.parse_buckets(spec, 64, device) == expected


@pytest.mark.parametrize("spec", ["8,x", "0,8", ""])
def test_bad_bucket_flags_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="--batch-token-buckets"):
        batching.parse_buckets(spec, 64, "cpu")


def test_a_model_that_batches_exactly_passes_the_start_up_probe() -> None:
    assert batching.batching_refusal(llama()) is None
    assert batching.batching_refusal(mistral()) is None


def test_a_model_that_ignores_the_hand_built_mask_is_served_one_session_at_a_time() -> None:
    class IgnoresMasks(torch.nn.Module):
        """A model that drops the attention mask it is given (as an architecture might)."""

        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, **kwargs):  # type: ignore[no-untyped-def]
            kwargs.pop("attention_mask", None)
            return self.inner(**kwargs)

        def get_input_embeddings(self):  # type: ignore[no-untyped-def]
            return self.inner.get_input_embeddings()

        def get_output_embeddings(self):  # type: ignore[no-untyped-def]
            return self.inner.get_output_embeddings()

    broken = IgnoresMasks(llama())
    assert batching.batching_refusal(broken) is not None
    scheduler = StepScheduler(max_sessions=8, max_tokens=64)
    start(scheduler, broken)
    assert scheduler.max_sessions == 1


def test_a_shared_pass_that_fails_costs_only_the_bad_step() -> None:
    """Found in review: one session's failure in a shared pass failed every session in it."""
    model = llama()
    scheduler = StepScheduler(max_sessions=8, max_tokens=64)
    start(scheduler, model)
    vocab_rows = model.get_input_embeddings().weight.shape[0]

    async def run() -> None:
        good = [KVSession(f"g{i}", VOCAB) for i in range(3)]
        bad = KVSession("bad", VOCAB)
        results = await asyncio.gather(*(scheduler(Pass(s, 0, (3, 4, 5))) for s in good),
                                       scheduler(Pass(bad, 0, (3, vocab_rows + 7))),  # no such row
                                       return_exceptions=True)
        assert all(isinstance(r, batching.PassOutput) for r in results[:3])
        assert isinstance(results[3], Exception)
        for s, r in zip(good, results[:3], strict=True):
            assert isinstance(r, batching.PassOutput)
            alone = batching.single(model, Pass(KVSession("a", VOCAB), 0, (3, 4, 5)))
            assert torch.allclose(r.logits, alone.logits, atol=TOLERANCE) and s.length == 3

    asyncio.run(run())


def test_two_sessions_do_not_fall_into_lockstep() -> None:
    """Found by the load sweep: two clients never shared a pass, each arriving while the
    other's pass ran. A tick now waits for the last passes' sessions where their joining saves
    a pass."""
    model = llama()
    seen: list[batching.BatchStats] = []
    scheduler = StepScheduler(max_sessions=8, max_tokens=64, on_batch=seen.append)
    start(scheduler, model)

    async def decode(session: KVSession, delay: float) -> None:
        await asyncio.sleep(delay)
        await scheduler(Pass(session, 0, (3, 4, 5, 6, 7, 8, 9, 10)))
        for token in range(30):
            await scheduler(Pass(session, session.length, (3 + token % 20,)))

    async def both() -> None:
        await asyncio.gather(decode(KVSession("a", VOCAB), 0.0), decode(KVSession("b", VOCAB), 0.0005))

    asyncio.run(both())
    assert sum(s.sessions == 2 for s in seen) > 20, [s.sessions for s in seen]


def test_a_tick_waits_for_sessions_whose_joining_saves_more_than_the_wait() -> None:
    flat = batching.PassCosts({1: 100.0, 4: 102.0, 16: 110.0})  # a fixed cost per pass
    due = [batching.Expected(0.010, 0.022, 1), batching.Expected(0.020, 0.042, 1),
           batching.Expected(0.300, 0.602, 1)]
    # Two back in 10-20 ms save a 100 ms pass: waited for, until the later one's latest return;
    # the one 300 ms away costs more than its pass saves.
    assert batching.awaited(due, queued_tokens=1, room_sessions=8, room_tokens=64, costs=flat) == 0.042
    assert batching.awaited(due[2:], queued_tokens=1, room_sessions=8, room_tokens=64, costs=flat) == 0.0
    # No room for a second: only the first is worth its wait.
    assert batching.awaited(due, queued_tokens=1, room_sessions=1, room_tokens=64, costs=flat) == 0.022
    assert batching.awaited(due, queued_tokens=63, room_sessions=8, room_tokens=64, costs=flat) == 0.022
    # Where every token costs its own share (compute-bound), a shared pass saves nothing.
    linear = batching.PassCosts({1: 10.0, 2: 20.0, 4: 40.0})
    assert batching.awaited(due, queued_tokens=1, room_sessions=8, room_tokens=64, costs=linear) == 0.0
    # Nothing measured yet: nothing to gain.
    assert batching.awaited(due, queued_tokens=1, room_sessions=8, room_tokens=64,
                            costs=batching.PassCosts()) == 0.0


def test_pass_costs_read_sizes_between_and_past_those_measured() -> None:
    costs = batching.PassCosts({1: 100.0, 5: 140.0, 9: 200.0})
    assert costs(1) == 100.0 and costs(3) == 120.0  # between: on the line
    assert costs(13) == 260.0  # past the largest: the last two's slope
    costs.add(5, 240.0)  # a moving average of what passes take
    assert costs(5) == 160.0 and costs.saving_ms(2, 3) == 115.0 + 130.0 - 160.0
    assert batching.PassCosts({4: 80.0})(8) == 160.0  # one size: no fixed cost assumed


def test_sessions_away_at_a_draft_join_the_pass_they_save() -> None:
    """The split under load: sessions come back from a draft on hardware of its own (here
    80 ms away, a third of a 240 ms pass whose cost hardly depends on its tokens), in two
    cohorts. Waiting up to a quarter of a pass, the target ran the cohorts in turn, half
    full; waiting where the joining saves a pass, it runs them together."""
    model = llama()
    seen: list[batching.BatchStats] = []
    scheduler = StepScheduler(max_sessions=8, max_tokens=64, on_batch=seen.append)
    start(scheduler, model)

    def slow(module: torch.nn.Module, args: object) -> None:
        threading.Event().wait(0.24)  # a flat pass: the same wait whatever its tokens

    model.model.layers[0].register_forward_pre_hook(slow)

    async def decode(session: KVSession, delay: float) -> None:
        await asyncio.sleep(delay)
        await scheduler(Pass(session, 0, (3, 4, 5, 6)))
        for token in range(8):
            await asyncio.sleep(0.08)  # drafting the next block
            await scheduler(Pass(session, session.length, (3 + token % 20, 4, 5)))

    async def cohorts() -> None:  # the second cohort arrives while the first one's pass runs
        await asyncio.gather(*(decode(KVSession(f"s{i}", VOCAB), 0.0 if i < 2 else 0.12) for i in range(4)))

    asyncio.run(cohorts())
    assert sum(s.sessions == 4 for s in seen) >= 5, [s.sessions for s in seen]


def test_cohorts_merge_when_a_round_trip_outlasts_the_old_fixed_wait() -> None:
    """Found by the load sweep: 8 real sessions split into two cohorts of 4 that took turns at
    the target, each arriving while the other's pass ran, because a tick waited at most 5% of
    a pass (20 ms) and a round trip through the orchestrator took longer. Here a pass takes
    ~200 ms and each session is 15 ms away between its passes: a tick waits for sessions that
    usually return within a quarter of a pass (the defaults), so the cohorts merge."""
    model = llama()
    seen: list[batching.BatchStats] = []
    scheduler = StepScheduler(max_sessions=8, max_tokens=64, on_batch=seen.append)
    start(scheduler, model)

    def slow(module: torch.nn.Module, args: object) -> None:
        threading.Event().wait(0.2)  # a pass as slow, next to its round trips, as on a CPU

    model.model.layers[0].register_forward_pre_hook(slow)

    async def decode(session: KVSession, delay: float) -> None:
        await asyncio.sleep(delay)
        await scheduler(Pass(session, 0, (3, 4, 5, 6)))
        for token in range(12):
            await asyncio.sleep(0.015)  # the reply's way to the orchestrator and the next step's back
            await scheduler(Pass(session, session.length, (3 + token % 20,)))

    async def cohorts() -> None:  # the second cohort arrives while the first one's pass runs
        await asyncio.gather(*(decode(KVSession(f"s{i}", VOCAB), 0.0 if i < 2 else 0.05) for i in range(4)))

    asyncio.run(cohorts())
    assert sum(s.sessions == 4 for s in seen) >= 8, [s.sessions for s in seen]


@pytest.mark.parametrize("flat", [True, False])
def test_drafting_ahead_yields_to_steps_where_its_rows_cost_their_own_share(flat: bool) -> None:
    """Found by the split sweep: on a compute-bound draft (llama.cpp on one core) drafting
    ahead's guesses filled passes of 15-28 rows for 8 sessions, and every session's block
    waited for them. A guess's pass now joins a step's pass only where it rides nearly free (a
    flat v); else the step's pass runs first, and the guess when no step waits."""
    model = llama()
    seen: list[batching.BatchStats] = []
    scheduler = StepScheduler(max_sessions=8, max_tokens=64, on_batch=seen.append)
    start(scheduler, model)

    def slow(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        threading.Event().wait(0.06 if flat else 0.02 * args[0].shape[-1])

    model.get_input_embeddings().register_forward_pre_hook(slow)

    async def run() -> list[str]:
        measured = KVSession("measured", VOCAB)
        for n in (1, 2, 4, 1, 2, 4):  # v(T), as a service measures it
            await scheduler(Pass(measured, measured.length, tuple(range(3, 3 + n))))
        measured.closed = True
        done: list[str] = []
        busy = asyncio.ensure_future(scheduler(Pass(KVSession("busy", VOCAB), 0, (3, 4, 5, 6))))
        await asyncio.sleep(0.03)  # the worker is in busy's pass: both below queue meanwhile
        guess = asyncio.ensure_future(scheduler(Pass(KVSession("guess", VOCAB), 0, (3, 4),
                                                     optional_until=asyncio.Event())))
        step = asyncio.ensure_future(scheduler(Pass(KVSession("step", VOCAB), 0, (3, 4))))
        guess.add_done_callback(lambda _: done.append("guess"))
        step.add_done_callback(lambda _: done.append("step"))
        await asyncio.gather(busy, guess, step)
        return done

    done = asyncio.run(run())
    if flat:
        assert seen[-1].sessions == 2, [s.sessions for s in seen]
    else:
        assert [s.sessions for s in seen[-2:]] == [1, 1] and done == ["step", "guess"]


def test_a_guess_a_step_waits_for_is_a_steps_pass() -> None:
    needed = asyncio.Event()
    p = Pass(KVSession("g", VOCAB), 0, (3,), optional_until=needed)
    assert not p.required
    needed.set()
    assert p.required and Pass(KVSession("s", VOCAB), 0, (3,)).required


def test_a_batched_pass_attends_session_by_session(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each session's rows attend over its own cache as the cache holds it: no call sees
    another session's keys (the scores between sessions are never computed), no session's KV
    is copied into a shared tensor, a one-token row gets no mask at all, and the logits stay
    exact."""
    model = llama()
    lengths = (3, 6, 2)
    sessions = [KVSession(f"s{i}", VOCAB) for i in range(len(lengths))]
    batching.batched(model, [Pass(s, 0, tuple(range(2, 2 + n))) for s, n in zip(sessions, lengths, strict=True)],
                     None)
    seen: list[tuple[int, int, int, tuple[int, ...] | None]] = []
    sdpa = batching.sdpa_attention_forward

    def spy(module, query, key, value, mask, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append((query.shape[-2], key.shape[-2], key.data_ptr(), None if mask is None else tuple(mask.shape)))
        return sdpa(module, query, key, value, mask, *args, **kwargs)

    monkeypatch.setattr(batching, "sdpa_attention_forward", spy)
    passes = [Pass(s, n, (7,) * (i + 1), logits_to_keep=i + 1) for i, (s, n) in enumerate(zip(sessions, lengths,
                                                                                               strict=True))]
    outputs = batching.batched(model, passes, None)
    layers = model.config.num_hidden_layers
    # (query rows, keys, mask shape): 1 new token after 3, 2 after 6, 3 after 2.
    assert sorted((q, k, m) for q, k, _, m in seen) == sorted(
        [(1, 4, None)] * layers + [(2, 8, (1, 1, 2, 8))] * layers + [(3, 5, (1, 1, 3, 5))] * layers)
    held = {layer.keys.data_ptr() for s in sessions for layer in s.cache.layers}
    assert {ptr for _, _, ptr, _ in seen} <= held  # each session's own cache tensor, uncopied
    for s, n, p, out in zip(sessions, lengths, passes, outputs, strict=True):
        expected = full_pass(model, list(range(2, 2 + n)) + list(p.token_ids))[-p.logits_to_keep:]
        assert torch.allclose(out.logits, expected, atol=TOLERANCE)


@pytest.mark.parametrize("sessions", [1, 3])
def test_a_pass_nobody_waits_for_stops_at_the_next_layer(sessions: int) -> None:
    """Cancelled while it runs (drafting ahead's guesses, once the outcome rules them out), a
    pass stops before its next layer: the layers after it never run, every cache is as it was,
    and the next pass is exact."""
    model = LlamaForCausalLM(LlamaConfig(**{**SMALL, "num_hidden_layers": 4})).eval()
    scheduler = StepScheduler(max_sessions=8, max_tokens=64)
    start(scheduler, model)
    entered, release = threading.Event(), threading.Event()
    ran: list[int] = []
    for i, layer in enumerate(model.model.layers):
        def hook(module, args, i=i):  # type: ignore[no-untyped-def]
            ran.append(i)
            if i == 0 and not release.is_set():
                entered.set()
                release.wait(10)
        layer.register_forward_pre_hook(hook)
    prompts = [[3 + s, 4, 5] for s in range(sessions)]
    held = [KVSession(f"s{s}", VOCAB) for s in range(sessions)]

    async def run() -> None:
        for session, prompt in zip(held, prompts, strict=True):
            await scheduler(Pass(session, 0, tuple(prompt)))
        release.clear()
        ran.clear()
        steps = [asyncio.ensure_future(scheduler(Pass(s, 3, (6, 7)))) for s in held]
        while not entered.is_set():  # the pass is on its first layer
            await asyncio.sleep(0.001)
        for step in steps:
            step.cancel()
        await asyncio.sleep(0)
        release.set()
        for session in held:
            await session.still()
        assert ran == [0]  # layers 1-3 never ran
        assert [s.length for s in held] == [3] * sessions
        for session, prompt in zip(held, prompts, strict=True):
            out = await scheduler(Pass(session, 3, (8,)))
            assert torch.allclose(out.logits, full_pass(model, [*prompt, 8])[-1:], atol=TOLERANCE)

    release.set()
    asyncio.run(run())


def test_a_pass_someone_still_waits_for_runs_to_the_end() -> None:
    model = llama()
    scheduler = StepScheduler(max_sessions=8, max_tokens=64)
    start(scheduler, model)

    async def run() -> None:
        a, b = KVSession("a", VOCAB), KVSession("b", VOCAB)
        gone = asyncio.ensure_future(scheduler(Pass(a, 0, (3, 4))))
        kept = asyncio.ensure_future(scheduler(Pass(b, 0, (5, 6))))
        await asyncio.sleep(0)
        gone.cancel()
        out = await kept
        assert torch.allclose(out.logits, full_pass(model, [5, 6])[-1:], atol=TOLERANCE)

    asyncio.run(run())


def test_a_tree_pass_alone_gets_its_mask_from_its_numbers_not_a_dense_host_mask(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where batched passes serve the model, a tree's pass alone runs as a batch of one: its
    mask is built on the device from the session's numbers (and a tensor-parallel rank 0 sends
    those numbers), never the dense [tokens, keys] mask `forward_segment` builds on the host."""
    model = llama()
    segment = tree_segment((5, 6, 7), (-1, 0, -1))
    alone = batching.single(model, Pass(KVSession("ref", VOCAB), 0, (3, 4), 1, segment, with_hidden=True))

    def dense(*args: object, **kwargs: object) -> None:
        raise AssertionError("a lone tree pass built a dense mask on the host")

    scheduler = StepScheduler(max_sessions=8, max_tokens=64)
    start(scheduler, model)  # its probe compares batched trees with `forward_segment`'s
    monkeypatch.setattr(batching, "forward_segment", dense)
    session = KVSession("s", VOCAB)
    out = asyncio.run(scheduler(Pass(session, 0, (3, 4), 1, segment, with_hidden=True)))
    assert torch.allclose(out.logits, alone.logits, atol=TOLERANCE)
    assert out.hidden is not None and alone.hidden is not None
    assert torch.allclose(out.hidden, alone.hidden, atol=TOLERANCE)
    assert session.length == 2  # the tree was forgotten


def test_a_batched_pass_builds_its_masks_on_each_device_its_layers_run_on() -> None:
    """Found in review: the masks were built once, on the first layer's device, so a model
    spread over devices by a device map attended with masks on the wrong one."""
    from transformers import DynamicCache

    from tandem.lm import BatchCache, Layout, Rows

    segment = tree_segment((5, 6), (-1, 0))
    batch = BatchCache([DynamicCache(), DynamicCache()],
                       Layout((Rows(4, 2, segment.offsets, segment.visible), Rows(3, 2)), window=4))
    cpu, meta = batch.masks(torch.device("cpu")), batch.masks(torch.device("meta"))
    assert batch.masks(torch.device("cpu")) is cpu  # built once a pass per device
    for on_cpu, on_meta in zip(cpu, meta, strict=True):
        assert on_cpu is not None and on_meta is not None
        assert on_cpu.device.type == "cpu" and on_meta.device.type == "meta"
        assert on_cpu.shape == on_meta.shape


def chained(session: KVSession, prompt: list[int], steps: int, tokens: list[int],
            threads: set[str]) -> Pass:
    """A greedy run of `steps` tokens as one call: each pass names the next (`Pass.then`)."""
    def then(out: batching.PassOutput) -> Pass | None:
        threads.add(threading.current_thread().name)
        tokens.append(int(out.logits[-1].argmax()))
        return Pass(session, session.length, (tokens[-1],), then=then) if len(tokens) < steps else None

    return Pass(session, 0, tuple(prompt), then=then)


def test_a_run_of_passes_goes_on_on_the_worker_and_shares_passes_with_other_sessions() -> None:
    """A decode run's passes follow each other on the forward worker, with no return to the
    event loop between them: one call serves the whole run, and another session's plain
    steps still share its passes."""
    model = llama()
    seen: list[batching.BatchStats] = []
    scheduler = StepScheduler(max_sessions=8, max_tokens=64, on_batch=seen.append)
    start(scheduler, model)
    tokens: list[int] = []
    threads: set[str] = set()

    async def both() -> list[int]:
        run = scheduler(chained(KVSession("run", VOCAB), [3, 4, 5], 40, tokens, threads))
        plain, _ = await asyncio.gather(greedy(scheduler, [6, 7, 8], 30), run)
        return plain

    plain = asyncio.run(both())
    assert tokens == asyncio.run(greedy(batching.direct(model), [3, 4, 5], 40))
    assert plain == asyncio.run(greedy(batching.direct(model), [6, 7, 8], 30))
    assert threads == {"forward"}
    assert sum(s.sessions for s in seen) == 40 + 30
    assert max(s.sessions for s in seen) == 2  # the plain steps rode along with the run


def test_a_cancelled_run_stops_and_leaves_its_session_free() -> None:
    model = llama()
    seen: list[batching.BatchStats] = []
    scheduler = StepScheduler(max_sessions=8, max_tokens=64, on_batch=seen.append)
    start(scheduler, model)
    tokens: list[int] = []

    async def run() -> None:
        session = KVSession("run", VOCAB)
        call = asyncio.ensure_future(scheduler(chained(session, [3, 4, 5], 10_000, tokens, set())))
        while len(tokens) < 3:
            await asyncio.sleep(0.001)
        call.cancel()
        await session.still()  # the run's one pending pass is over
        assert not session.pending

    asyncio.run(run())
    assert len(seen) < 1000  # stopped far short of its 10,000 passes


def test_a_fault_around_the_forward_fails_its_pass_and_the_worker_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found when a replica restarted with mismatched modules: the pass's split could not be
    built, the error killed the forward worker, and the replica hung while it said SERVING.
    A fault outside the model's forward now fails only the passes of that tick."""
    model = llama()
    scheduler = StepScheduler(max_sessions=4, max_tokens=64)
    start(scheduler, model)
    clocks = [batching.host.begin]

    def broken_clock() -> batching.host.PassClock:
        monkeypatch.setattr(batching.host, "begin", clocks[0])  # once
        raise TypeError("a split that cannot be built")

    async def run() -> None:
        monkeypatch.setattr(batching.host, "begin", broken_clock)
        with pytest.raises(TypeError, match="a split that cannot be built"):
            await asyncio.wait_for(scheduler(Pass(KVSession("first", VOCAB), 0, (3, 4))), 10)
        out = await asyncio.wait_for(scheduler(Pass(KVSession("next", VOCAB), 0, (3, 4))), 10)
        assert torch.allclose(out.logits, full_pass(model, [3, 4])[-1:], atol=TOLERANCE)

    asyncio.run(run())


def test_a_run_takes_turns_with_other_sessions_when_a_pass_serves_one() -> None:
    """With one session a pass, a run's next pass queues behind those already waiting: a
    plain step waits one pass, not for the run to end."""
    model = llama()
    seen: list[batching.BatchStats] = []
    scheduler = StepScheduler(max_sessions=1, max_tokens=64, on_batch=seen.append)
    start(scheduler, model)
    tokens: list[int] = []
    runs = 0

    async def both() -> None:
        nonlocal runs
        run = asyncio.ensure_future(scheduler(chained(KVSession("run", VOCAB), [3, 4, 5], 40, tokens, set())))
        while len(tokens) < 2:
            await asyncio.sleep(0.001)
        await scheduler(Pass(KVSession("plain", VOCAB), 0, (6, 7)))
        runs = len(tokens)
        await run

    asyncio.run(both())
    assert runs < 10, f"the plain step waited for {runs} of the run's 40 passes"
