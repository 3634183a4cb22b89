"""A decode run's one-token passes through the static slot (tandem.decode_graph) against the
model's own forward: the same logits (float32 rounding, every argmax equal) whatever the
session meets in between: passes shared with other sessions, rollbacks, another session
taking the slot. Eager here (the compiled step once, in a slow test); on a GPU the compiled
step is captured as a CUDA graph."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from tandem import batching, decode_graph
from tandem.batching import Pass, PassOutput, StepScheduler
from tandem.decode_graph import DecodeGraph
from tandem.kv import KVSession, SessionTable

VOCAB = 40
TOLERANCE = 1e-4
SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
         "initializer_range": 0.3}


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL)).eval()
    batching.use_batched_attention(model)
    return model


def full_pass(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0]


def scheduler_on(model: torch.nn.Module, graph: DecodeGraph, max_sessions: int = 8,
                 seen: list[batching.BatchStats] | None = None) -> StepScheduler:
    scheduler = StepScheduler(max_sessions=max_sessions, max_tokens=64,
                              on_batch=seen.append if seen is not None else lambda stats: None)
    scheduler.start(batching.TorchRunner(model, graph), batching.batching_refusal(model))
    return scheduler


async def decode(scheduler: StepScheduler, session: KVSession, position: int, new: tuple[int, ...],
                 steps: int) -> list[torch.Tensor]:
    """A greedy decode run of `steps` passes from `position` (one call: each pass names the
    next); the logits of each."""
    rows: list[torch.Tensor] = []

    def then(out: PassOutput) -> Pass | None:
        rows.append(out.logits[-1].clone())
        token = int(out.logits[-1].argmax())
        return Pass(session, session.length, (token,), then=then) if len(rows) < steps else None

    await scheduler(Pass(session, position, new, then=then))
    return rows


def check(model: torch.nn.Module, history: list[int], rows: list[torch.Tensor]) -> list[int]:
    """Each row is the model's own last-position logits after the history up to it (the run's
    tokens are each row's argmax); the tokens."""
    tokens = [int(r.argmax()) for r in rows]
    full = full_pass(model, history + tokens[:-1])
    for i, row in enumerate(rows):
        assert torch.allclose(row, full[len(history) - 1 + i], atol=TOLERANCE), i
    return tokens


def views_slot(session: KVSession, graph: DecodeGraph) -> bool:
    return all(layer.keys.data_ptr() == slot.keys.data_ptr()
               for layer, slot in zip(session.cache.layers, graph.slots, strict=True))


def test_a_run_alone_goes_through_the_slot_and_matches_the_model() -> None:
    model = llama()
    graph = DecodeGraph(model, 128, compiled=False)
    seen: list[batching.BatchStats] = []
    scheduler = scheduler_on(model, graph, seen=seen)
    session = KVSession("run", VOCAB)

    async def run() -> list[torch.Tensor]:
        return await decode(scheduler, session, 0, (3, 4, 5), 30)

    rows = asyncio.run(run())
    check(model, [3, 4, 5], rows)
    assert views_slot(session, graph)  # its cache is the slot's first positions, uncopied
    assert session.length == 3 + 29
    assert [s.split.captured for s in seen] == [0] + [1] * 29  # the prompt's pass is not one token


def test_a_run_that_shares_passes_leaves_the_slot_and_comes_back_exact() -> None:
    """Another session's plain steps share some of the run's passes (the batched path, which
    appends a new tensor to the run's cache) and not others (the slot, reloaded): both exact."""
    model = llama()
    graph = DecodeGraph(model, 128, compiled=False)
    seen: list[batching.BatchStats] = []
    scheduler = scheduler_on(model, graph, seen=seen)
    run_session, plain_session = KVSession("run", VOCAB), KVSession("plain", VOCAB)

    async def plain(steps: int) -> list[torch.Tensor]:
        rows = []
        out = await scheduler(Pass(plain_session, 0, (6, 7, 8)))
        for _ in range(steps):
            rows.append(out.logits[-1].clone())
            await asyncio.sleep(0.002)  # now beside the run's passes, now not
            out = await scheduler(Pass(plain_session, plain_session.length, (int(out.logits[-1].argmax()),)))
        return rows

    async def both() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return await asyncio.gather(decode(scheduler, run_session, 0, (3, 4, 5), 60), plain(12))

    run_rows, plain_rows = asyncio.run(both())
    check(model, [3, 4, 5], run_rows)
    check(model, [6, 7, 8], plain_rows)
    assert max(s.sessions for s in seen) == 2  # some passes were shared


def test_a_rollback_and_a_second_owner_keep_every_cache_exact() -> None:
    """With one session a pass, two runs take turns at the slot: each new owner first gives
    the old one its own copy. A run resent from part way (a rollback inside the slot's
    positions) decodes what the model does from there."""
    model = llama()
    graph = DecodeGraph(model, 128, compiled=False)
    scheduler = scheduler_on(model, graph, max_sessions=1)
    a, b = KVSession("a", VOCAB), KVSession("b", VOCAB)

    async def run() -> None:
        first, other = await asyncio.gather(decode(scheduler, a, 0, (3, 4, 5), 25),
                                            decode(scheduler, b, 0, (9, 8), 25))
        tokens = check(model, [3, 4, 5], first)
        check(model, [9, 8], other)
        assert not (views_slot(a, graph) and views_slot(b, graph))
        # a again, rolled back to 10 tokens: from its own cache, wherever that now lives.
        again = await decode(scheduler, a, 10, (tokens[7],), 20)
        check(model, [3, 4, 5, *tokens[:8]], again)
        # b, whose cache the slot gave back, goes on exactly.
        held = [9, 8, *(int(r.argmax()) for r in other)][:b.length]
        out = await scheduler(Pass(b, b.length, (7,)))
        assert torch.allclose(out.logits[-1], full_pass(model, [*held, 7])[-1], atol=TOLERANCE)

    asyncio.run(run())


def test_an_owner_between_steps_keeps_the_slot() -> None:
    """Between its steps a session's cache is the event loop's (a step may cut it): another
    session's run does not take the slot from it then, but runs uncaptured; once the owner is
    gone, the slot is the next run's."""
    model = llama()
    graph = DecodeGraph(model, 128, compiled=False)
    seen: list[batching.BatchStats] = []
    scheduler = scheduler_on(model, graph, seen=seen)
    table = SessionTable(max_sessions=4)
    handle, a = table.open("a", VOCAB)
    b = KVSession("b", VOCAB)

    async def run() -> None:
        check(model, [3, 4, 5], await decode(scheduler, a, 0, (3, 4, 5), 10))
        seen.clear()
        check(model, [9, 8], await decode(scheduler, b, 0, (9, 8), 10))
        assert views_slot(a, graph) and not views_slot(b, graph)
        assert sum(s.split.captured for s in seen) == 0
        a.rollback(6)  # on the event loop, as a step would
        assert a.length == 6
        again = await decode(scheduler, a, 6, (7,), 10)
        check(model, [*a.token_ids[:6], 7], again)
        assert views_slot(a, graph)

    asyncio.run(run())
    table.close(handle)  # the owner's stream ended
    c = KVSession("c", VOCAB)
    check(model, [2, 2], asyncio.run(decode(scheduler, c, 0, (2, 2), 10)))
    assert views_slot(c, graph)


def test_a_session_longer_than_the_slot_goes_on_uncaptured() -> None:
    model = llama()
    graph = DecodeGraph(model, 16, compiled=False)
    scheduler = scheduler_on(model, graph)
    session = KVSession("long", VOCAB)
    rows = asyncio.run(decode(scheduler, session, 0, (3, 4, 5), 30))
    check(model, [3, 4, 5], rows)
    assert session.length == 32 and not views_slot(session, graph)


def test_the_start_up_probe_passes_a_model_the_slot_reproduces() -> None:
    assert DecodeGraph(llama(), 64, compiled=False).warm() is None


def test_the_slot_is_refused_where_it_would_not_be_exact(caplog: pytest.LogCaptureFixture) -> None:
    """A sliding window, shorter than the slot or not: the slot's mask is causal only, and
    transformers' sliding static layers roll their keys once full."""
    torch.manual_seed(0)
    for window in (8, 64):
        model = MistralForCausalLM(MistralConfig(**SMALL, sliding_window=window)).eval()
        with caplog.at_level(logging.WARNING):
            assert decode_graph.build(model, decode_graph.EAGER, 64, "cpu") is None
        assert f"its attention has a sliding window ({window} tokens)" in caplog.text
    assert decode_graph.build(llama(), decode_graph.AUTO, 64, "cpu") is None  # auto: off on a CPU
    with pytest.raises(ValueError, match="--decode-graph must be one of"):
        decode_graph.build(llama(), "graphs", 64, "cpu")


@pytest.mark.slow
def test_the_compiled_step_compiles_whole_and_matches_the_model() -> None:
    """fullgraph: the step has no graph break (no host sync, no data-dependent branch), which
    is what a CUDA graph's capture needs; on this CPU inductor compiles it instead."""
    model = llama()
    graph = DecodeGraph(model, 64, compiled=True)
    assert graph.warm() is None
    scheduler = scheduler_on(model, graph)
    session = KVSession("compiled", VOCAB)
    rows = asyncio.run(decode(scheduler, session, 0, (3, 4, 5), 20))
    check(model, [3, 4, 5], rows)
    assert views_slot(session, graph)
