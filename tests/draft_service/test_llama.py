"""The llama.cpp draft backend: a tiny GGUF draft (the tests' noisy copy of the tiny target,
written with the gguf package) computes what its Hugging Face twin does, rolls back and
branches like a fresh sequence, and through real services leaves the output the target's."""

from __future__ import annotations

import asyncio
import gc
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from laws import PARAMS_ID, T1, TRUNCATED, assert_law_through, small_pair
from replicas import replica_state, wait_for_baseline
from tiny import PROMPTS, greedy_reference, make_gguf, make_tokenizer, random_prompts, speculated
from transformers import AutoModelForCausalLM

from draft_service.proposer import Drafter, draw, fork
from tandem import llama, sampling
from tandem.batching import Pass, PassOutput
from tandem.kv import KVSession, SessionTable, fork_cache, free_cache
from tandem.launch import Stack, start_stack
from tandem.prefix import PrefixCache

pytestmark = pytest.mark.skipif(not llama.available(), reason="llama-cpp-python is not installed")

LENGTH = 24
VOCAB = len(make_tokenizer())


@pytest.fixture(scope="module")
def gguf_draft(tiny_dir: Path, tiny_draft: Path) -> Path:
    return make_gguf(tiny_draft, tiny_dir / "gguf-draft")


@pytest.fixture(scope="module")
def engine(gguf_draft: Path) -> Iterator[llama.LlamaEngine]:
    # Float32 keys, values and attention: what is compared below differs by float32 rounding only.
    e = llama.LlamaEngine(str(gguf_draft), context_tokens=4096, max_batch_tokens=64, threads=1,
                          float32_attention=True)
    yield e
    e.close()


def session(engine: llama.LlamaEngine, name: str = "s") -> KVSession:
    return KVSession(name, engine.vocab_size, new_cache=engine.new_cache)


def fresh_logits(engine: llama.LlamaEngine, history: list[int]) -> torch.Tensor:
    """The next-token logits of a new sequence fed `history`."""
    return engine.single(Pass(session(engine, "fresh"), 0, tuple(history))).logits[-1]


def test_the_gguf_draft_computes_what_its_hf_twin_does(engine: llama.LlamaEngine,
                                                       tiny_draft: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_draft, dtype=torch.float32).eval()
    ids = make_tokenizer().encode(PROMPTS[0])
    got = engine.single(Pass(session(engine), 0, tuple(ids), logits_to_keep=len(ids))).logits
    with torch.inference_mode():
        want = model(torch.tensor([ids])).logits[0]
    assert engine.vocab_size == VOCAB and got.shape == want.shape
    # A wrong rotary layout or a misplaced weight would move them by whole units.
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_rollback_and_branching_match_a_fresh_sequence(engine: llama.LlamaEngine) -> None:
    rng = random.Random(0)
    sessions = [session(engine, f"s{i}") for i in range(3)]
    for s in sessions:
        engine.single(Pass(s, 0, tuple(rng.randrange(2, VOCAB) for _ in range(6))))
    branches: list[KVSession] = []
    for _ in range(25):
        s = rng.choice(sessions + branches)
        keep = rng.randrange(1, s.length + 1)  # accepted prefix: roll back to it, then extend
        new = tuple(rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 5)))
        out = engine.batched([Pass(s, keep, new)], ())[0]
        torch.testing.assert_close(out.logits[-1], fresh_logits(engine, s.held_tokens),
                                   atol=1e-4, rtol=1e-4)
        if rng.random() < 0.3:  # a guess drafted in a copy cut at a random point
            branches.append(fork(s, rng.randrange(1, s.length + 1)))
        if len(branches) > 4:
            branches.pop(0)  # dropped: its sequence is released at the next pass
    # Several sessions in one decode: each gets its own logits.
    passes = [Pass(s, s.length, (rng.randrange(2, VOCAB),)) for s in sessions]
    for p, out in zip(passes, engine.batched(passes, ()), strict=True):
        torch.testing.assert_close(out.logits[-1], fresh_logits(engine, p.session.held_tokens),
                                   atol=1e-4, rtol=1e-4)


def test_released_caches_give_their_sequences_back(engine: llama.LlamaEngine) -> None:
    gc.collect()  # sessions of the tests above are dropped: their releases are queued
    kept = session(engine, "kept")
    engine.single(Pass(kept, 0, (4,)))  # a pass applies what is queued
    free = len(engine.free)
    caches = [session(engine, f"r{i}") for i in range(5)]
    for s in caches:
        engine.single(Pass(s, 0, (2, 3)))
    assert len(engine.free) == free - 5
    del caches, s
    engine.single(Pass(kept, 1, (5,)))  # the next pass applies the releases
    assert len(engine.free) == free


def test_copies_share_cells_and_the_count_is_what_the_context_holds(gguf_draft: Path) -> None:
    """The pool has 512 cells for caches (and 256 for one decode's new tokens). A 300-token
    prefix copied into four sessions that add 40 tokens each holds 460 cells, as `Cells`
    counts them: were the copies' cells their own (1,540), or a cut's cells left in the pool,
    llama.cpp would find no room for the decodes below."""
    small = llama.LlamaEngine(str(gguf_draft), context_tokens=512, max_batch_tokens=64, threads=1)
    try:
        rng = random.Random(3)
        prefix = session(small, "prefix")
        small.single(Pass(prefix, 0, tuple(rng.randrange(2, VOCAB) for _ in range(300))))
        assert small.held_tokens == 300
        copies = [fork(prefix, 300) for _ in range(4)]
        assert small.held_tokens == 300
        for c in copies:
            small.single(Pass(c, 300, tuple(rng.randrange(2, VOCAB) for _ in range(40))))
        assert small.held_tokens == 460
        assert small.cells.freed_by([copies[0].cache.cells]) == 40
        assert small.cells.freed_by([prefix.cache.cells]) == 0  # every copy holds it too
        assert small.cells.freed_by([c.cache.cells for c in [prefix, *copies]]) == 460
        # Cut back, a cache's cells go back to the pool (at the next decode, in llama.cpp).
        for c in copies:
            c.rollback(100)
        prefix.rollback(50)
        assert small.held_tokens == 100
        for c in copies[:3]:  # 3 x 150 more: 550 held, and room in the 768 cells only if the
            # cells cut were freed (the prefix's 250 past 50, the fourth copy's 40)
            small.single(Pass(c, 100, tuple(rng.randrange(2, VOCAB) for _ in range(150))))
        assert small.held_tokens == 550
        del copies, c
        gc.collect()
        assert small.held_tokens == 50  # the prefix alone
    finally:
        small.close()


def test_the_budget_counts_a_shared_prefix_once(gguf_draft: Path) -> None:
    """A 300-token prefix kept, then four sessions from it of 340 tokens each: 460 cells in a
    512-token budget, so no session is evicted (counted per holder they would need 1,660). A
    fifth session of 100 new tokens needs 48 cells: the kept entry frees nothing while the
    sessions share its cells, so it stays, and the two least recently used sessions go (40
    cells of their own each)."""
    small = llama.LlamaEngine(str(gguf_draft), context_tokens=512, max_batch_tokens=64, threads=1)
    table = SessionTable(16, 512, PrefixCache(max_tokens=512, max_entries=4, fork=fork_cache,
                                              free=free_cache), cells=small.cells)
    rng = random.Random(4)
    prompt = [rng.randrange(2, VOCAB) for _ in range(300)]

    def step(history: list[int]) -> KVSession:
        _, s = table.open(f"s{len(table)}", small.vocab_size, small.new_cache)
        start = table.start_from_prefix(s, history)
        table.reserve(s, len(history))
        small.single(Pass(s, start, tuple(history[start:])))
        table.settle(s)
        return s

    try:
        first = step(prompt)
        table.close(1)
        assert first.closed and table.prefix is not None and table.prefix.tokens == 300
        sessions = [step([*prompt, *(rng.randrange(2, VOCAB) for _ in range(40))]) for _ in range(4)]
        assert small.held_tokens == 460 and table.cached_tokens == 460
        assert not any(s.evicted for s in sessions) and table.prefix.tokens == 300
        step([rng.randrange(2, VOCAB) for _ in range(100)])
        assert [s.evicted for s in sessions] == [True, True, False, False]
        assert table.prefix.tokens == 300 and small.held_tokens == 300 + 2 * 40 + 100
    finally:
        small.close()


def test_the_same_logits_give_the_same_q_and_token_on_both_backends(engine: llama.LlamaEngine) -> None:
    """A draft's q comes from Tandem's sampling code whatever runs the model: the llama.cpp
    draft's logits, handed to the drafter as a transformers backend would hand them, give the
    same q, ranking and drawn token."""
    seen: list[PassOutput] = []

    async def on_llama(p: Pass) -> PassOutput:
        seen.append(engine.single(p))
        return seen[-1]

    async def replayed(p: Pass) -> PassOutput:
        p.session.extend(p.cache_position, p.token_ids)
        return seen[0]

    params, history = sampling.SamplingParams(temperature=1.5, top_k=5, top_p=0.9), [3, 5, 7, 9]
    mine = asyncio.run(Drafter(on_llama, session(engine), params, 8, seed=11).at(history))[0]
    theirs = asyncio.run(Drafter(replayed, KVSession("t", VOCAB), params, 8, seed=11).at(history))[0]
    assert mine == theirs
    support, probs = sampling.truncate(sampling.probabilities(seen[0].logits, params)[0], 8)
    assert mine.q.token_ids == tuple(support.tolist()) and mine.q.probs == tuple(probs.tolist())
    assert draw(mine.q, 11, 4) == draw(theirs.q, 11, 4)


# --- through real services ----------------------------------------------------------------

METRICS = ["--metrics-port", "0"]


@pytest.fixture(scope="module")
def llama_stack(gguf_draft: Path, tiny_target: Path) -> Iterator[Stack]:
    stack = start_stack(str(gguf_draft.parent), str(tiny_target),
                        draft_args=["--backend", "llama.cpp", *METRICS], target_args=METRICS,
                        orchestrator_args=["--overlap", "on"])
    yield stack
    stack.stop()


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_output_with_the_llama_draft_equals_target_generate(llama_stack: Stack, reference,  # type: ignore[no-untyped-def]
                                                                   k: int) -> None:
    hits = misses = 0
    with llama_stack.client() as client:
        for prompt in PROMPTS:
            tokens, usage = speculated(client, prompt, LENGTH, k)  # every step drafted k
            assert tokens == reference(prompt, LENGTH), (k, prompt)
            assert 0 < usage.accepted_tokens < usage.drafted_tokens
            hits, misses = hits + usage.draft_cache_hits, misses + usage.draft_cache_misses
    assert hits and misses, (hits, misses)  # drafting ahead both hit and missed


@pytest.mark.slow
def test_the_llama_draft_says_what_runs_it(llama_stack: Stack) -> None:
    import grpc

    from tandem.v1 import common_pb2, draft_pb2_grpc

    with grpc.insecure_channel(llama_stack.drafts[0].address) as channel:
        info = draft_pb2_grpc.DraftServiceStub(channel).GetModelInfo(
            common_pb2.GetModelInfoRequest(), timeout=30).info
    assert info.matmul_path == "llama.cpp" and info.vocab_size == VOCAB
    assert info.dtype.startswith("gguf") and len(info.pass_times) > 0


@pytest.mark.slow
@pytest.mark.parametrize("params", [T1, TRUNCATED], ids=PARAMS_ID.get)
def test_sampled_law_holds_with_the_llama_draft(tiny_dir: Path, params: sampling.SamplingParams) -> None:
    target, draft = small_pair(tiny_dir)
    gguf = make_gguf(draft, tiny_dir / "v6-gguf")
    stack = start_stack(str(gguf.parent), str(target), draft_args=["--backend", "llama.cpp"])
    assert_law_through(stack, target, params)


@pytest.mark.slow
def test_evictions_under_the_budget_rebuild_and_the_gauges_return_to_zero(
        gguf_draft: Path, tiny_target: Path) -> None:
    # Room for about two sessions' caches: four concurrent requests evict each other.
    stack = start_stack(str(gguf_draft.parent), str(tiny_target),
                        draft_args=["--backend", "llama.cpp", "--kv-budget-tokens", "64", *METRICS],
                        target_args=METRICS)
    try:
        baseline = replica_state(stack)
        prompts = random_prompts(VOCAB, 4, 12, seed=9)
        from concurrent.futures import ThreadPoolExecutor

        def run(prompt: list[int]) -> list[int]:
            with stack.client() as client:
                return list(client.generate(prompt, max_new_tokens=20, num_speculative_tokens=4,
                                            ignore_eos=True).token_ids)

        with ThreadPoolExecutor(4) as pool:
            outputs = list(pool.map(run, prompts))
        assert outputs == [greedy_reference(tiny_target, p, 20) for p in prompts]
        wait_for_baseline(stack, baseline)
    finally:
        stack.stop()


@pytest.mark.slow
def test_a_killed_llama_draft_loses_nothing(gguf_draft: Path, tiny_target: Path) -> None:
    import signal

    stack = start_stack(str(gguf_draft.parent), str(tiny_target), draft_args=["--backend", "llama.cpp"])
    try:
        prompt, tokens = random_prompts(VOCAB, 1, 12, seed=4)[0], []
        with stack.client() as client:
            for message in client.generate_stream(prompt, max_new_tokens=60,
                                                  num_speculative_tokens=4, ignore_eos=True):
                if message.HasField("delta"):
                    if not tokens:
                        stack.drafts[0].proc.send_signal(signal.SIGKILL)
                    tokens.extend(message.delta.token_ids)
        assert tokens == greedy_reference(tiny_target, prompt, 60)
    finally:
        stack.stop()


@pytest.mark.slow
def test_what_the_llama_backend_cannot_run_is_refused_in_one_line(gguf_draft: Path, tiny_draft: Path,
                                                                 tiny_target: Path) -> None:
    from tandem.launch import spawn

    for argv, message in (
            (["draft-service", "--model", str(tiny_draft), "--backend", "llama.cpp"],
             "--backend llama.cpp needs a GGUF model"),
            (["draft-service", "--model", str(gguf_draft), "--backend", "llama.cpp", "--quantize",
              "int8-dynamic"], "a GGUF file carries its own quantization"),
            (["draft-service", "--model", str(gguf_draft), "--backend", "onnx"],
             "--backend must be one of")):
        with pytest.raises(RuntimeError) as err:
            spawn(argv)
        assert message in str(err.value), argv


@pytest.mark.slow
def test_a_gguf_file_llama_cpp_cannot_load_is_refused_in_one_line_before_listening(
        gguf_draft: Path) -> None:
    import subprocess
    import sys

    broken = gguf_draft.parent / "broken" / "draft.gguf"
    broken.parent.mkdir(exist_ok=True)
    broken.write_bytes(gguf_draft.read_bytes()[:4096])  # its header, the tensors cut off
    result = subprocess.run([sys.executable, "-m", "tandem.cli", "draft-service", "--model",
                             str(broken)], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 1
    assert "listening on" not in result.stdout + result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert f"llama.cpp cannot load {broken}" in result.stderr
