"""The target on llama.cpp: a tiny GGUF target whose attention projections carry biases (as
Qwen2's do) computes what its Hugging Face twin does, a block's rows are what one-token passes
give, and through real services the output at every k is the target's own, under greedy and
under sampling; --backend auto times both backends and keeps the faster."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from laws import T1, TRUNCATED, assert_law_through, small_pair
from tiny import make_draft_like, make_gguf, make_model, make_tokenizer, random_prompts, speculated
from transformers import AutoModelForCausalLM

from tandem import llama, sampling
from tandem.batching import Pass
from tandem.kv import KVSession
from tandem.launch import Stack, spawn, start_stack, wait_serving
from tandem.model_service import LLAMA_CPP, TRANSFORMERS, choose_backend
from tandem.v1 import common_pb2, target_pb2_grpc

needs_llama = pytest.mark.skipif(not llama.available(), reason="llama-cpp-python is not installed")

LENGTH = 24


@pytest.fixture(scope="module")
def biased_target(tiny_dir: Path) -> Path:
    return make_model(tiny_dir / "biased-target", seed=1, attention_bias=True)


@pytest.fixture(scope="module")
def gguf_target(tiny_dir: Path, biased_target: Path) -> Path:
    return make_gguf(biased_target, tiny_dir / "gguf-target")


@pytest.fixture(scope="module")
def gguf_draft(tiny_dir: Path, biased_target: Path) -> Path:
    return make_gguf(make_draft_like(biased_target, tiny_dir / "biased-draft", noise=0.05, seed=2),
                     tiny_dir / "gguf-biased-draft")


def session(engine: llama.LlamaEngine, name: str) -> KVSession:
    return KVSession(name, engine.vocab_size, new_cache=engine.new_cache)


@needs_llama
def test_the_gguf_target_computes_what_its_hf_twin_does(gguf_target: Path, biased_target: Path) -> None:
    """A reference outside llama.cpp: the unconverted float32 model, biases included (a bias
    lost or misplaced in the file moves the logits by whole units)."""
    engine = llama.LlamaEngine(str(gguf_target), context_tokens=512, max_batch_tokens=64, threads=1,
                               float32_attention=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(biased_target, dtype=torch.float32).eval()
        assert any(name.endswith("q_proj.bias") for name, _ in model.named_parameters())
        ids = random_prompts(engine.vocab_size, 1, 20, seed=3)[0]
        got = engine.single(Pass(session(engine, "s"), 0, tuple(ids), logits_to_keep=len(ids))).logits
        with torch.inference_mode():
            want = model(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    finally:
        engine.close()


@needs_llama
def test_a_blocks_rows_are_what_one_token_passes_give_to_float32_rounding(gguf_target: Path) -> None:
    """On float32 weights, served as the target is served (float16 keys and values, llama.cpp's
    default attention), each row of a k+1-token block is the row a one-token pass at that
    position gives, up to float32 rounding: llama.cpp rounds a block and a lone token
    differently, never by more here (docs/ARCHITECTURE.md, "Exact on llama.cpp", has what
    quantized weights do)."""
    engine = llama.LlamaEngine(str(gguf_target), context_tokens=512, max_batch_tokens=64, threads=2)
    try:
        prompt = random_prompts(engine.vocab_size, 1, 12, seed=5)[0]
        block = random_prompts(engine.vocab_size, 1, 9, seed=6)[0]
        blocked = session(engine, "block")
        engine.single(Pass(blocked, 0, tuple(prompt)))
        rows_at_once = engine.single(Pass(blocked, len(prompt), tuple(block), logits_to_keep=len(block))).logits
        stepped = session(engine, "steps")
        engine.single(Pass(stepped, 0, tuple(prompt)))
        one_by_one = torch.stack([engine.single(Pass(stepped, len(prompt) + i, (t,))).logits[-1]
                                  for i, t in enumerate(block)])
        torch.testing.assert_close(rows_at_once, one_by_one, atol=1e-4, rtol=1e-4)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def llama_target_stack(gguf_draft: Path, gguf_target: Path) -> Iterator[Stack]:
    stack = start_stack(str(gguf_draft.parent), str(gguf_target.parent),
                        draft_args=["--backend", "llama.cpp"], target_args=["--backend", "llama.cpp"])
    yield stack
    stack.stop()


def target_info(stack: Stack) -> common_pb2.ModelInfo:
    with grpc.insecure_channel(stack.targets[0].address) as channel:
        return target_pb2_grpc.TargetServiceStub(channel).GetModelInfo(  # type: ignore[no-any-return]
            common_pb2.GetModelInfoRequest(), timeout=30).info


@needs_llama
@pytest.mark.slow
def test_greedy_output_at_every_k_equals_the_llama_targets_own(llama_target_stack: Stack) -> None:
    info = target_info(llama_target_stack)
    assert info.backend == LLAMA_CPP and len(info.pass_times) > 0
    assert common_pb2.PROPOSER_LOOKAHEAD not in info.proposers  # it scores no token trees
    prompts = random_prompts(info.vocab_size, 3, 10, seed=7)
    accepted = drafted = 0
    with llama_target_stack.client() as client:
        for prompt in prompts:
            alone = list(client.generate(prompt, max_new_tokens=LENGTH, num_speculative_tokens=0,
                                         ignore_eos=True).token_ids)  # one decode run on the target
            for k in (1, 4, 8):
                tokens, usage = speculated(client, prompt, LENGTH, k)
                assert tokens == alone, (k, prompt)
                accepted, drafted = accepted + usage.accepted_tokens, drafted + usage.drafted_tokens
    assert 0 < accepted < drafted  # rejections were rolled back on the target's sequences


@needs_llama
@pytest.mark.slow
def test_under_a_grammar_every_k_and_logprobs_are_the_llama_targets_own(llama_target_stack: Stack,
                                                                       gguf_target: Path) -> None:
    """Greedy under a grammar: speculation's output is the target's own k = 0 output (a decode
    run masked on the target), the draft on llama.cpp drafting under the same masks; the
    log-probabilities it returns are the target's own log-softmax over the file."""
    grammar = common_pb2.Grammar(regex="(yes|no), [a-z]{2,6}( [a-z]{1,5}){0,3}\\.")
    prompts = [make_tokenizer().encode(p) for p in ("a grammar: ", "the answer is ")]
    engine = llama.LlamaEngine(str(gguf_target), context_tokens=512,
                               max_batch_tokens=64, threads=1)
    try:
        with llama_target_stack.client() as client:
            for prompt in prompts:
                alone = client.generate(prompt, max_new_tokens=LENGTH, num_speculative_tokens=0, grammar=grammar)
                for k in (1, 4):
                    reply = client.generate(prompt, max_new_tokens=LENGTH, num_speculative_tokens=k,
                                            proposer="draft-model", grammar=grammar, logprobs=3)
                    assert list(reply.token_ids) == list(alone.token_ids), (k, prompt)
                    assert reply.usage.grammar_forced_tokens > 0
                    tokens = list(reply.token_ids)
                    rows = engine.single(Pass(session(engine, f"lp{k}"), 0, tuple(prompt + tokens),
                                              logits_to_keep=len(tokens) + 1)).logits
                    want = torch.log_softmax(rows[:-1].float(), -1)
                    got = torch.tensor([t.logprob for t in reply.logprobs])
                    torch.testing.assert_close(got, want[torch.arange(len(tokens)), torch.tensor(tokens)],
                                               atol=1e-2, rtol=0)
    finally:
        engine.close()


@needs_llama
@pytest.mark.slow
def test_a_request_longer_than_the_llama_context_is_refused_with_the_limit(
        gguf_target: Path, gguf_draft: Path) -> None:
    stack = start_stack(str(gguf_draft.parent), str(gguf_target.parent),
                        draft_args=["--backend", "llama.cpp"],
                        target_args=["--backend", "llama.cpp", "--kv-budget-tokens", "64"])
    try:
        with stack.client() as client:
            with pytest.raises(grpc.RpcError) as err:
                client.generate([3] * 40, max_new_tokens=40, num_speculative_tokens=4)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "context of 64 tokens" in (err.value.details() or "")
            # The replica goes on serving.
            assert len(client.generate([3] * 10, max_new_tokens=8, num_speculative_tokens=4,
                                       ignore_eos=True).token_ids) == 8
    finally:
        stack.stop()


@needs_llama
@pytest.mark.slow
def test_a_later_turn_from_kept_sequences_decodes_what_a_cold_one_does(
        llama_target_stack: Stack, gguf_target: Path, gguf_draft: Path) -> None:
    """Both tiers keep a finished session's sequence and start the next turn from a copy of it
    (llama_memory_seq_cp); the turn decodes what the same request does on replicas that keep
    nothing."""
    first = random_prompts(target_info(llama_target_stack).vocab_size, 1, 30, seed=9)[0]
    with llama_target_stack.client() as client:
        reply = client.generate(first, max_new_tokens=LENGTH, num_speculative_tokens=4, ignore_eos=True)
        second = [*first, *reply.token_ids, 3, 4]
        deadline = time.monotonic() + 30
        while True:  # the first turn's sessions close just after its reply
            warm = client.generate(second, max_new_tokens=LENGTH, num_speculative_tokens=4, ignore_eos=True)
            if warm.usage.target_cached_tokens or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert len(first) + LENGTH - 1 <= warm.usage.target_cached_tokens < len(second)
    assert warm.usage.draft_cached_tokens >= len(first)
    off = ["--backend", "llama.cpp", "--prefix-cache", "off"]
    cold_stack = start_stack(str(gguf_draft.parent), str(gguf_target.parent), draft_args=off, target_args=off)
    try:
        with cold_stack.client() as client:
            cold = client.generate(second, max_new_tokens=LENGTH, num_speculative_tokens=4, ignore_eos=True)
    finally:
        cold_stack.stop()
    assert cold.usage.target_cached_tokens == cold.usage.draft_cached_tokens == 0  # --prefix-cache off
    assert list(warm.token_ids) == list(cold.token_ids)


@needs_llama
@pytest.mark.slow
@pytest.mark.parametrize("params, long_prompt", [(T1, True), (TRUNCATED, False)],
                         ids=["t1-kept-prefixes", "truncated"])
def test_sampled_law_holds_with_the_llama_target(tiny_dir: Path, params: sampling.SamplingParams,
                                                 long_prompt: bool) -> None:
    """Both tiers on llama.cpp; the law is the target's own (its float32 twin's rows: llama.cpp's
    float16 keys move them by about 1e-3, far below what these samples resolve). With the long
    prompt, every request after the first starts from kept sequences on both tiers (the
    truncated case samples cold ones)."""
    target, draft = small_pair(tiny_dir)
    target_gguf = make_gguf(target, tiny_dir / "v6-target-gguf")
    draft_gguf = make_gguf(draft, tiny_dir / "v6-draft-gguf-t")
    stack = start_stack(str(draft_gguf.parent), str(target_gguf.parent),
                        draft_args=["--backend", "llama.cpp"], target_args=["--backend", "llama.cpp"])
    assert_law_through(stack, target, params, long_prompt=long_prompt)


def test_auto_keeps_the_backend_expected_to_serve_more_tokens_with_speculation() -> None:
    # Flat blocks (a float32 path on oneDNN) against cheap one-token passes whose blocks cost
    # their tokens one by one (llama.cpp's Q4_K on an AVX2 CPU).
    flat = {1: 300.0, 2: 320.0, 3: 340.0, 5: 400.0}
    linear = {1: 60.0, 2: 102.0, 3: 142.0, 5: 209.0}
    chosen, rates = choose_backend({TRANSFORMERS: flat, LLAMA_CPP: linear})
    assert chosen == LLAMA_CPP and rates[LLAMA_CPP] == pytest.approx(1000 / 60)  # judged on T = 1
    slow_plain = {1: 200.0, 2: 400.0, 3: 600.0, 5: 1000.0}
    chosen, rates = choose_backend({LLAMA_CPP: slow_plain, TRANSFORMERS: flat})
    assert chosen == TRANSFORMERS and rates[TRANSFORMERS] > 1000 / 300  # judged on a block


@needs_llama
@pytest.mark.slow
def test_auto_times_both_backends_for_a_model_both_run(tiny_dir: Path, biased_target: Path,
                                                       gguf_target: Path) -> None:
    both = tiny_dir / "both-backends"
    shutil.copytree(biased_target, both, dirs_exist_ok=True)
    shutil.copy(gguf_target, both / "target.gguf")
    process = spawn(["target-service", "--model", str(both), "--threads", "1"])
    try:
        wait_serving(process)
        with grpc.insecure_channel(process.address) as channel:
            info = target_pb2_grpc.TargetServiceStub(channel).GetModelInfo(
                common_pb2.GetModelInfoRequest(), timeout=30).info
    finally:
        process.stop()
    timed = {t.backend: t for t in info.backend_timings}
    assert set(timed) == {LLAMA_CPP, TRANSFORMERS}
    assert all(len(t.pass_times) > 0 and t.expected_tokens_per_s > 0 for t in timed.values())
    assert info.backend == max(timed, key=lambda b: timed[b].expected_tokens_per_s)
    assert [p.pass_ms for p in info.pass_times] == [p.pass_ms for p in timed[info.backend].pass_times]


@needs_llama
@pytest.mark.slow
def test_what_the_llama_target_cannot_run_is_refused_in_one_line(gguf_target: Path,
                                                                biased_target: Path) -> None:
    for argv, message in (
            (["target-service", "--model", str(biased_target), "--backend", "llama.cpp"],
             "--backend llama.cpp needs a GGUF model"),
            (["target-service", "--model", str(gguf_target), "--backend", "llama.cpp",
              "--medusa-heads", "heads"], "--medusa-heads reads the target's hidden states"),
            (["target-service", "--model", str(gguf_target), "--backend", "llama.cpp",
              "--tensor-parallel-size", "2"], "does not combine with --tensor-parallel-size")):
        with pytest.raises(RuntimeError) as err:
            spawn(argv)
        assert message in str(err.value), argv
