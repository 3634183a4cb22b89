"""End to end through three real processes on loopback, with tiny random models (fp32)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from scrape import sample
from tiny import PROMPTS, greedy_reference, make_model, make_tokenizer, speculated

from tandem.client import TandemClient
from tandem.launch import Stack, restart, spawn, start_stack, wait_serving
from tandem.v1 import common_pb2, orchestrator_pb2

LENGTH = 40


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_output_equals_target_generate(tiny_stack: Stack, reference, prompt: str, k: int) -> None:  # type: ignore[no-untyped-def]
    with tiny_stack.client() as client:
        tokens, usage = speculated(client, prompt, LENGTH, k)  # every step drafted k, no fallback
    assert tokens == reference(prompt, LENGTH)
    assert 0 <= usage.accepted_tokens <= usage.drafted_tokens
    # Each target pass commits the accepted tokens plus one recovered or bonus token.
    assert usage.completion_tokens == usage.accepted_tokens + usage.target_forward_passes
    # At most one rejection per pass; the drafts after it are never tested.
    assert usage.rejected_tokens <= usage.target_forward_passes
    assert usage.accepted_tokens + usage.rejected_tokens <= usage.drafted_tokens


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_prompt_lookup_greedy_output_equals_target_generate(tiny_stack: Stack, reference, prompt: str,  # type: ignore[no-untyped-def]
                                                            k: int) -> None:
    with tiny_stack.client() as client:
        reply = client.generate(prompt, max_new_tokens=LENGTH, num_speculative_tokens=k,
                                proposer="prompt-lookup", ignore_eos=True)
    assert list(reply.token_ids) == reference(prompt, LENGTH)
    usage = reply.usage
    assert usage.proposer == common_pb2.PROPOSER_PROMPT_LOOKUP
    assert usage.completion_tokens == usage.accepted_tokens + usage.target_forward_passes
    assert usage.accepted_tokens <= usage.drafted_tokens


def test_prompt_lookup_proposes_on_repeated_text(tiny_stack: Stack, tiny_target: Path) -> None:
    # A prompt that already holds "P, then the target's continuation of P", then P again:
    # lookup proposes that continuation. (Whether a random tiny model copies it is up to the
    # model; test_distribution.py shows lookup proposals being accepted and rejected.)
    prompt = make_tokenizer().encode(PROMPTS[0])
    repeated = prompt + greedy_reference(tiny_target, prompt, LENGTH) + prompt
    with tiny_stack.client() as client:
        reply = client.generate(repeated, max_new_tokens=LENGTH, num_speculative_tokens=4,
                                proposer="prompt-lookup", ignore_eos=True)
    assert list(reply.token_ids) == greedy_reference(tiny_target, repeated, LENGTH)
    assert reply.usage.drafted_tokens > 0


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("proposer", ["suffix", "auto"])
def test_suffix_and_auto_greedy_output_equals_target_generate(tiny_stack: Stack, tiny_target: Path,
                                                              proposer: str, k: int) -> None:
    """Over a prompt that repeats itself (P, the target's continuation of P, then P), suffix
    decoding proposes that continuation; auto takes it or the draft's block, step by step."""
    prompt = make_tokenizer().encode(PROMPTS[1])
    repeated = prompt + greedy_reference(tiny_target, prompt, LENGTH) + prompt
    with tiny_stack.client() as client:
        reply = client.generate(repeated, max_new_tokens=LENGTH, num_speculative_tokens=k,
                                proposer=proposer, ignore_eos=True)
    assert list(reply.token_ids) == greedy_reference(tiny_target, repeated, LENGTH)
    usage = reply.usage
    assert usage.proposer == (common_pb2.PROPOSER_SUFFIX if proposer == "suffix" else common_pb2.PROPOSER_AUTO)
    assert usage.completion_tokens == usage.accepted_tokens + usage.target_forward_passes
    assert usage.suffix_accepted_tokens <= usage.suffix_drafted_tokens <= usage.drafted_tokens
    if proposer == "suffix":
        assert usage.suffix_drafted_tokens == usage.drafted_tokens > 0
        assert usage.suffix_accepted_tokens > 0  # the repeat is the target's own continuation


def test_suffix_decoding_proposes_what_an_earlier_request_generated(tiny_stack: Stack, tiny_target: Path) -> None:
    """A request's output is kept for every later request: the same prompt again is proposed
    the first reply's tokens, and greedy keeps nearly all of them."""
    prompt = make_tokenizer().encode(PROMPTS[2]) + [7, 11, 13]  # a history of its own
    with tiny_stack.client() as client:
        first = client.generate(prompt, max_new_tokens=LENGTH, num_speculative_tokens=0, ignore_eos=True)
        again = client.generate(prompt, max_new_tokens=LENGTH, num_speculative_tokens=8,
                                proposer="suffix", ignore_eos=True)
    assert list(again.token_ids) == list(first.token_ids) == greedy_reference(tiny_target, prompt, LENGTH)
    assert again.usage.suffix_accepted_tokens >= LENGTH // 2


def test_a_killed_orchestrator_loses_only_its_suffix_index(tiny_stack: Stack, tiny_target: Path) -> None:
    """The shared index is a cache of traffic: an orchestrator of its own over the stack's
    replicas learns a reply, is SIGKILLed and started again, and serves the same request
    exactly, with the index empty (nothing of the first reply proposed) until traffic fills it."""
    prompt = make_tokenizer().encode(PROMPTS[0]) + [17, 19, 23]
    argv = ["orchestrator", "--draft", tiny_stack.drafts[0].address, "--target", tiny_stack.targets[0].address]
    orchestrator = spawn(argv)
    try:
        wait_serving(orchestrator)
        with TandemClient(orchestrator.address) as client:
            client.generate(prompt, max_new_tokens=LENGTH, num_speculative_tokens=0, ignore_eos=True)
            learned = client.generate(prompt, max_new_tokens=LENGTH, num_speculative_tokens=8,
                                      proposer="suffix", ignore_eos=True)
        orchestrator.proc.kill()
        orchestrator.proc.wait()
        orchestrator = restart(orchestrator)
        with TandemClient(orchestrator.address) as client:
            fresh = client.generate(prompt, max_new_tokens=LENGTH, num_speculative_tokens=8,
                                    proposer="suffix", ignore_eos=True)
    finally:
        orchestrator.stop()
    assert list(fresh.token_ids) == list(learned.token_ids) == greedy_reference(tiny_target, prompt, LENGTH)
    assert learned.usage.suffix_accepted_tokens > fresh.usage.suffix_accepted_tokens


@pytest.fixture(scope="module")
def lookahead_stacks(tiny_stack: Stack, tiny_target: Path) -> Iterator[dict[str, Stack]]:
    """W,N,G -> a stack whose target runs Lookahead with them (tiny_stack: the default 5,3,5)."""
    other = start_stack(None, str(tiny_target), target_args=["--lookahead", "3,4,2"])
    yield {"5,3,5": tiny_stack, "3,4,2": other}
    other.stop()


@pytest.mark.slow  # a stack of its own (CI runs it)
@pytest.mark.parametrize("wng", ["5,3,5", "3,4,2"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_lookahead_greedy_output_equals_target_generate(lookahead_stacks: dict[str, Stack], reference,  # type: ignore[no-untyped-def]
                                                        prompt: str, wng: str) -> None:
    with lookahead_stacks[wng].client() as client:
        reply = client.generate(prompt, max_new_tokens=LENGTH, num_speculative_tokens=4,
                                proposer="lookahead", ignore_eos=True)
    assert list(reply.token_ids) == reference(prompt, LENGTH)
    usage = reply.usage
    assert usage.proposer == common_pb2.PROPOSER_LOOKAHEAD
    assert usage.drafted_tokens > 0
    assert usage.accepted_tokens <= usage.drafted_tokens
    # The last pass may accept a path longer than the tokens still wanted (the target does
    # not know max_new_tokens); the orchestrator drops the excess.
    assert 0 <= usage.accepted_tokens + usage.target_forward_passes - usage.completion_tokens < 4


def test_lookahead_accepts_n_grams_once_the_output_loops(tiny_stack: Stack, reference) -> None:  # type: ignore[no-untyped-def]
    # The tiny target's greedy continuation of "hello world" settles into "(((..." after ~18
    # tokens; the Jacobi window converges to it and the pool's "(" -> ("(", "(") n-gram is then
    # accepted whole. Deterministic for this seeded model (about 16 of 40 tokens accepted).
    with tiny_stack.client() as client:
        reply = client.generate(PROMPTS[1], max_new_tokens=LENGTH, num_speculative_tokens=4,
                                proposer="lookahead", ignore_eos=True)
    assert list(reply.token_ids) == reference(PROMPTS[1], LENGTH)
    assert reply.usage.accepted_tokens >= 10
    assert reply.usage.target_forward_passes <= LENGTH - 10


def test_plain_target_decoding_through_the_services(tiny_stack: Stack, reference) -> None:  # type: ignore[no-untyped-def]
    """The target decoding alone is one request to it, a run answered token by token: no
    round trip per token."""
    target = tiny_stack.targets[0]
    requests_before = sample(target, "tandem_replica_step_duration_seconds_count")
    with tiny_stack.client() as client:
        reply = client.generate(PROMPTS[0], max_new_tokens=LENGTH, num_speculative_tokens=0, ignore_eos=True)
    assert list(reply.token_ids) == reference(PROMPTS[0], LENGTH)
    assert reply.usage.drafted_tokens == 0
    assert reply.usage.target_forward_passes == LENGTH
    assert sample(target, "tandem_replica_step_duration_seconds_count") - requests_before == 1


def test_streaming_matches_unary_and_ends_with_usage(tiny_stack: Stack, reference) -> None:  # type: ignore[no-untyped-def]
    with tiny_stack.client() as client:
        messages = list(client.generate_stream(PROMPTS[1], max_new_tokens=LENGTH, ignore_eos=True))
    assert all(m.HasField("delta") for m in messages[:-1])
    assert messages[-1].HasField("summary")
    summary = messages[-1].summary
    streamed = [t for m in messages[:-1] for t in m.delta.token_ids]
    assert streamed == reference(PROMPTS[1], LENGTH)
    assert summary.finish_reason == orchestrator_pb2.FINISH_REASON_LENGTH
    assert summary.usage.completion_tokens == LENGTH
    text = "".join(m.delta.text for m in messages[:-1])
    assert text == make_tokenizer().decode(streamed, skip_special_tokens=True)


def test_wire_traffic_is_sparse(tiny_stack: Stack) -> None:
    """O(k*K) numbers per step, never a vocabulary row: bytes per token stay small."""
    with tiny_stack.client() as client:
        reply = client.generate(PROMPTS[0], max_new_tokens=LENGTH, temperature=1.0, seed=1,
                                num_speculative_tokens=8, ignore_eos=True)
    assert 0 < reply.usage.wire_bytes / reply.usage.completion_tokens < 2048


@pytest.mark.parametrize("k", [0, 4])
def test_same_seed_same_output(tiny_stack: Stack, k: int) -> None:
    with tiny_stack.client() as client:
        runs = [client.generate(PROMPTS[0], max_new_tokens=LENGTH, temperature=1.0, top_p=0.9,
                                seed=seed, num_speculative_tokens=k, ignore_eos=True).token_ids
                for seed in (5, 5, 6)]
    assert list(runs[0]) == list(runs[1])
    assert list(runs[0]) != list(runs[2])


def test_concurrent_requests_do_not_share_cache_state(tiny_stack: Stack, reference) -> None:  # type: ignore[no-untyped-def]
    jobs = [(p, k) for p in PROMPTS for k in (1, 3, 5)]

    def run(job: tuple[str, int]) -> list[int]:
        with tiny_stack.client() as client:
            return list(client.generate(job[0], max_new_tokens=LENGTH, num_speculative_tokens=job[1],
                                        ignore_eos=True).token_ids)

    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        outputs = list(pool.map(run, jobs))
    assert outputs == [reference(p, LENGTH) for p, _ in jobs]


def test_stop_string_truncates_text(tiny_stack: Stack, reference) -> None:  # type: ignore[no-untyped-def]
    tokenizer = make_tokenizer()
    full = tokenizer.decode(reference(PROMPTS[0], LENGTH))
    stop = full[10:12]
    cut = full.index(stop)
    with tiny_stack.client() as client:
        reply = client.generate(PROMPTS[0], max_new_tokens=LENGTH, stop=[stop], ignore_eos=True)
    assert reply.text == full[:cut]
    assert reply.finish_reason == orchestrator_pb2.FINISH_REASON_STOP_STRING
    assert reply.usage.completion_tokens == len(reply.token_ids) < LENGTH
    # Drafted tokens cut off with the step's tail are not counted as accepted either: every
    # pass but the last yields at least one token that was not drafted.
    usage = reply.usage
    assert usage.accepted_tokens + usage.target_forward_passes - 1 <= usage.completion_tokens


# --- Medusa heads on the target: it proposes a token tree and verifies it in one pass ---

@pytest.fixture(scope="module")
def medusa_stack(tiny_target: Path, tiny_medusa: Path) -> Iterator[Stack]:
    # No draft service: the target proposes for itself.
    stack = start_stack(None, str(tiny_target), target_args=["--medusa-heads", str(tiny_medusa)])
    yield stack
    stack.stop()


@pytest.mark.slow  # a stack of its own (CI runs it)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_medusa_greedy_output_equals_target_generate(medusa_stack: Stack, reference, prompt: str) -> None:  # type: ignore[no-untyped-def]
    with medusa_stack.client() as client:
        reply = client.generate(prompt, max_new_tokens=LENGTH, proposer="medusa", ignore_eos=True)
    assert list(reply.token_ids) == reference(prompt, LENGTH)
    usage = reply.usage
    assert usage.proposer == common_pb2.PROPOSER_MEDUSA
    # Heads trained on the target's own text propose tokens it keeps.
    assert usage.drafted_tokens > 0 and usage.accepted_tokens > 0
    # The last step's tree may commit past max_new_tokens; the surplus is dropped.
    assert usage.completion_tokens <= usage.accepted_tokens + usage.target_forward_passes


@pytest.mark.slow  # a stack of its own (CI runs it)
def test_medusa_sampling_is_seeded(medusa_stack: Stack) -> None:
    with medusa_stack.client() as client:
        runs = [client.generate(PROMPTS[0], max_new_tokens=LENGTH, temperature=1.0, seed=seed,
                                proposer="medusa", ignore_eos=True).token_ids for seed in (5, 5, 6)]
    assert list(runs[0]) == list(runs[1]) != list(runs[2])


def test_medusa_is_refused_where_the_target_has_no_heads(tiny_stack: Stack) -> None:
    with tiny_stack.client() as client, pytest.raises(grpc.RpcError) as err:
        client.generate(PROMPTS[0], max_new_tokens=4, proposer="medusa")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "proposer medusa is not offered" in err.value.details()
    with tiny_stack.client() as client:  # ...and the next request is served
        assert client.generate(PROMPTS[0], max_new_tokens=2).usage.completion_tokens == 2


@pytest.mark.slow  # a stack of its own (CI runs it)
def test_a_default_proposer_no_target_runs_stops_the_orchestrator_at_start(tiny_target: Path) -> None:
    """Not INVALID_ARGUMENT for every request that leaves the proposer unset, blaming the client."""
    with pytest.raises(RuntimeError) as err:
        start_stack(None, str(tiny_target), target_args=["--lookahead", "off"],
                    orchestrator_args=["--proposer", "lookahead"])
    assert "--proposer lookahead: no target replica runs it" in str(err.value)


# --- A draft that never agrees: the first drafted token is rejected at every step ---

@pytest.mark.slow  # a stack of its own (CI runs it)
def test_first_draft_token_rejected_every_step(tiny_dir: Path, tiny_target: Path, reference) -> None:  # type: ignore[no-untyped-def]
    unrelated = make_model(tiny_dir / "unrelated", seed=99)
    stack = start_stack(str(unrelated), str(tiny_target))
    try:
        with stack.client() as client:
            reply = client.generate(PROMPTS[0], max_new_tokens=LENGTH, num_speculative_tokens=4,
                                    ignore_eos=True)
    finally:
        stack.stop()
    assert list(reply.token_ids) == reference(PROMPTS[0], LENGTH)
    assert reply.usage.drafted_tokens > 0
    assert reply.usage.accepted_tokens < reply.usage.drafted_tokens / 4
    # Nearly every block stops at a rejection: per tested token, acceptance stays low.
    usage = reply.usage
    assert usage.rejected_tokens > usage.target_forward_passes / 2
    assert usage.accepted_tokens / (usage.accepted_tokens + usage.rejected_tokens) < 0.5


# --- A draft identical to the target: every drafted token is accepted ---

@pytest.fixture(scope="module")
def eos_model(tiny_dir: Path) -> tuple[Path, list[int], int]:
    """A target whose EOS is a token it emits mid-generation; returns (path, greedy ids, eos index)."""
    plain = make_model(tiny_dir / "eos-probe", seed=3)
    tokenizer = make_tokenizer()
    ids = greedy_reference(plain, tokenizer.encode(PROMPTS[0]), LENGTH)
    # The first token that first occurs at index >= 6: inside the second or third block.
    index = next(i for i, t in enumerate(ids) if i >= 6 and t not in ids[:i])
    path = make_model(tiny_dir / "eos-target", seed=3, eos_token_id=ids[index])
    return path, ids, index


@pytest.fixture(scope="module")
def identical_stack(eos_model: tuple[Path, list[int], int]) -> Stack:
    path = eos_model[0]
    stack = start_stack(str(path), str(path))
    yield stack  # type: ignore[misc]
    stack.stop()


@pytest.mark.slow  # a stack of its own (CI runs it)
def test_all_drafted_tokens_accepted_takes_bonus(identical_stack: Stack, eos_model) -> None:  # type: ignore[no-untyped-def]
    _, ids, _ = eos_model
    with identical_stack.client() as client:
        reply = client.generate(PROMPTS[0], max_new_tokens=LENGTH, num_speculative_tokens=4,
                                ignore_eos=True)
    assert list(reply.token_ids) == ids
    usage = reply.usage
    assert usage.accepted_tokens == usage.drafted_tokens > 0
    # Prefill yields 1 token; every later pass yields 4 accepted + 1 bonus (k shrinks at the end).
    assert usage.target_forward_passes == 1 + -(-(LENGTH - 1) // 5)


@pytest.mark.slow  # a stack of its own (CI runs it)
@pytest.mark.parametrize("k", [0, 4])  # 0: the target's run ends at EOS
def test_eos_inside_an_accepted_block(identical_stack: Stack, eos_model, k: int) -> None:  # type: ignore[no-untyped-def]
    path, ids, index = eos_model
    expected = greedy_reference(path, make_tokenizer().encode(PROMPTS[0]), LENGTH, eos_token_id=ids[index])
    with identical_stack.client() as client:
        reply = client.generate(PROMPTS[0], max_new_tokens=LENGTH, num_speculative_tokens=k)
    assert list(reply.token_ids) == ids[: index + 1] == expected
    assert reply.finish_reason == orchestrator_pb2.FINISH_REASON_EOS
    assert reply.usage.completion_tokens == index + 1


@pytest.mark.slow  # a stack of its own (CI runs it)
@pytest.mark.parametrize("max_new_tokens", [1, 2, 7, 9])
@pytest.mark.parametrize("k", [0, 4])
def test_max_new_tokens_reached_mid_block(identical_stack: Stack, eos_model, max_new_tokens: int,  # type: ignore[no-untyped-def]
                                          k: int) -> None:
    _, ids, _ = eos_model
    with identical_stack.client() as client:
        reply = client.generate(PROMPTS[0], max_new_tokens=max_new_tokens, num_speculative_tokens=k,
                                ignore_eos=True)
    assert list(reply.token_ids) == ids[:max_new_tokens]
    assert reply.finish_reason == orchestrator_pb2.FINISH_REASON_LENGTH


# --- Bad input: precise status, and the server keeps serving ---

@pytest.mark.parametrize("fields, needle", [
    ({"prompt": ""}, "prompt is empty"),
    ({"max_new_tokens": 100_000}, "max_new_tokens"),
    ({"max_new_tokens": 600}, "context"),
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"num_speculative_tokens": 1000}, "num_speculative_tokens"),
    ({"stop": [""]}, "stop_strings"),
    ({"prompt": [9999]}, "prompt_token_ids"),
    # Gaps filled by the reliability work: each boundary just outside its range.
    ({"prompt": "a" * 600}, "context of 512 tokens"),
    ({"prompt": list(range(2, 30)) * 20}, "context of 512 tokens"),
    ({"prompt": [-1]}, "prompt_token_ids must be in [0, 36)"),
    ({"max_new_tokens": 4097}, "max_new_tokens must be in [1, 4096]"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": float("-inf")}, "temperature"),
    ({"top_p": -0.5}, "top_p must be in (0, 1]"),
    ({"top_p": float("nan")}, "top_p must be in (0, 1]"),
    ({"top_p": 1.0000001}, "top_p must be in (0, 1]"),
    ({"num_speculative_tokens": 17}, "num_speculative_tokens must be in [0, 16]"),
    ({"stop": ["x"] * 17}, "stop_strings: at most 16"),
    ({"stop": ["x" * 257]}, "each 1..256 characters"),
])
def test_invalid_requests_get_invalid_argument(tiny_stack: Stack, fields: dict, needle: str) -> None:  # type: ignore[type-arg]
    args = {"prompt": "hello", "max_new_tokens": 4, **fields}
    with tiny_stack.client() as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate(args.pop("prompt"), **args)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in err.value.details()
        assert client.generate("hello", max_new_tokens=3).usage.completion_tokens == 3


@pytest.mark.slow  # a stack of its own (CI runs it)
def test_mismatched_tokenizers_are_refused(tiny_dir: Path, tiny_target: Path) -> None:
    other = make_model(tiny_dir / "other-vocab", seed=4, chars="0123456789+-*/ ")
    with pytest.raises(RuntimeError, match="does not share a tokenizer"):
        start_stack(str(other), str(tiny_target))


# --- A lost replica: a clear UNAVAILABLE naming it, never UNKNOWN ---

@pytest.mark.slow  # a stack of its own (CI runs it)
def test_lost_target_replica_gives_unavailable(tiny_draft: Path, tiny_target: Path) -> None:
    stack = start_stack(str(tiny_draft), str(tiny_target))
    try:
        target = stack.targets[0]
        target.proc.kill()
        target.proc.wait()
        with stack.client() as client, pytest.raises(grpc.RpcError) as err:
            client.generate(PROMPTS[0], max_new_tokens=8)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert target.address in err.value.details()
    finally:
        stack.stop()


def test_client_deadline_gives_deadline_exceeded(tiny_stack: Stack) -> None:
    """The target is frozen (SIGSTOP) for the call, so no machine finishes it in time."""
    import signal

    target = tiny_stack.targets[0].proc
    with tiny_stack.client() as client:
        target.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(grpc.RpcError) as err:
                client.generate(PROMPTS[0], max_new_tokens=3, ignore_eos=True, timeout=1.0)
        finally:
            target.send_signal(signal.SIGCONT)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert client.generate(PROMPTS[0], max_new_tokens=3).usage.completion_tokens == 3
