"""What crosses the wire: each draft distribution is its top-K support, never a vocabulary row,
and the prompt is sent to each service once; a target step names its protocol (a oneof) and
its answer comes back as that protocol's own domain type.

A vocabulary of 16,386 tokens makes a dense row cost at least 65 KB (float32 probabilities
alone), so `usage.wire_bytes` tells the two apart by orders of magnitude; the 36-token
vocabulary of the other tests cannot (a dense row of it is 144 bytes).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from tiny import make_draft_like, make_model

from orchestrator import wire
from orchestrator.domain import EMPTY_BLOCK, DraftBlock, TargetScores, TreeCommit, shares_compute
from tandem import sampling
from tandem.launch import Stack, start_stack
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2

pytestmark = pytest.mark.slow  # its own stack, a 16k-token vocabulary (CI runs it)

# One character per token: 16,384 CJK ideographs, plus <eos> and <unk>.
CHARS = "".join(chr(0x4E00 + i) for i in range(16384))
VOCAB = len(CHARS) + 2
SUPPORT = 8  # the orchestrator's --max-support-size
DENSE_ROW_BYTES = 4 * VOCAB  # one vocabulary row of float32 probabilities, ids not counted


@pytest.fixture(scope="module")
def large_vocab(tiny_dir: Path) -> Iterator[Stack]:
    target = make_model(tiny_dir / "v16k-target", seed=21, chars=CHARS)
    draft = make_draft_like(target, tiny_dir / "v16k-draft", noise=0.05, seed=22)
    stack = start_stack(str(draft), str(target),
                        orchestrator_args=["--max-support-size", str(SUPPORT)])
    yield stack
    stack.stop()


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()  # type: ignore[no-any-return]


def test_the_draft_reports_top_k_supports(large_vocab: Stack) -> None:
    with grpc.insecure_channel(large_vocab.drafts[0].address) as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        assert stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=30).info.vocab_size == VOCAB
        [reply] = list(stub.ProposeBlocks(iter([draft_pb2.ProposeBlocksRequest(
            new_token_ids=prompt(8, 0), num_speculative_tokens=6, max_support_size=SUPPORT,
            sampling=common_pb2.SamplingParams(temperature=1.0), seed=3)]), timeout=60))
    assert len(reply.distributions) == 6
    for distribution in reply.distributions:
        assert len(distribution.token_ids) == len(distribution.probs) == SUPPORT
    assert reply.ByteSize() < DENSE_ROW_BYTES / 50


def test_a_request_sends_k_supports_per_drafted_token(large_vocab: Stack) -> None:
    with large_vocab.client() as client:
        reply = client.generate(prompt(8, 1), max_new_tokens=40, temperature=1.0, seed=1,
                                num_speculative_tokens=8, ignore_eos=True)
    usage = reply.usage
    assert usage.completion_tokens == 40 and usage.drafted_tokens >= 40
    # Each drafted token's distribution crosses twice (draft -> orchestrator -> target): with
    # K ids and probabilities, about 14·K bytes with the step's other fields; a dense row
    # would be over 2 · DENSE_ROW_BYTES, a thousand times more.
    assert usage.wire_bytes / usage.drafted_tokens < 32 * SUPPORT


def test_the_prompt_is_sent_once(large_vocab: Stack) -> None:
    """A 450-token prompt costs about 900 bytes per service: sent once to each, it is a fixed
    cost; resent with every step it would add that much again per step and service."""
    long = prompt(450, 2)
    prompt_bytes = target_pb2.ScoreBlocksRequest(new_token_ids=long, draft_proposal=target_pb2.DraftProposal()).ByteSize()
    with large_vocab.client() as client:
        short_reply = client.generate(prompt(8, 2), max_new_tokens=40, temperature=1.0, seed=4,
                                      num_speculative_tokens=2, ignore_eos=True)
        long_reply = client.generate(long, max_new_tokens=40, temperature=1.0, seed=4,
                                     num_speculative_tokens=2, ignore_eos=True)
    short, long_usage = short_reply.usage, long_reply.usage
    per_step = short.wire_bytes / short.target_forward_passes  # everything but the prompt
    steps = long_usage.target_forward_passes
    # Resent with each step, the prompt would add 2 · prompt_bytes per step, far over the slack.
    assert 2 * prompt_bytes > per_step
    assert long_usage.wire_bytes - 2 * prompt_bytes < 1.5 * steps * per_step
    assert long_usage.wire_bytes > 2 * prompt_bytes  # to the draft and to the target


# --- a target step's two protocols ---------------------------------------------------------

def test_a_target_step_names_its_proposal() -> None:
    greedy = sampling.SamplingParams()
    plain = wire.score_request_to_proto("s", 2, [5], EMPTY_BLOCK, "", greedy, 1)
    assert plain.WhichOneof("proposal") == "draft_proposal"  # k=0: a draft proposal, no tokens
    assert list(plain.draft_proposal.token_ids) == [] and plain.cache_position == 2
    block = DraftBlock((3,), (sampling.SparseDistribution((3, 4), (0.75, 0.25)),), (0.75,), 4, 0.0)
    drafted = wire.score_request_to_proto("s", 0, [5], block, "", greedy, 1)
    assert list(drafted.draft_proposal.token_ids) == [3]
    assert list(drafted.draft_proposal.distributions[0].token_ids) == [3, 4]
    tree = wire.score_request_to_proto("s", 0, [5], EMPTY_BLOCK, "medusa", greedy, 1)
    assert tree.WhichOneof("proposal") == "target_proposal"
    assert tree.target_proposal.proposer == common_pb2.PROPOSER_MEDUSA


def test_each_kind_of_answer_is_its_own_domain_type() -> None:
    scores = target_pb2.ScoreBlocksResponse(cache_length=3, compute_ms=1.5,
                                            block_scores=target_pb2.BlockScores(bonus_token_id=7))
    assert wire.target_result_from_proto(scores) == TargetScores(
        sampling.ScoredBlock((), (), 7), cache_length=3, compute_ms=1.5)
    tree = target_pb2.ScoreBlocksResponse(cache_length=3, compute_ms=1.5, verified_tree=target_pb2.VerifiedTree(
        committed_token_ids=[7], proposed_token_count=4))
    assert wire.target_result_from_proto(tree) == TreeCommit((7,), 4, cache_length=3, compute_ms=1.5)
    # Neither (a target older than the oneof): no guess from which fields are empty.
    assert wire.target_result_from_proto(target_pb2.ScoreBlocksResponse(cache_length=3)) is None


def test_replicas_share_compute_on_one_machine_only_where_their_cpus_or_gpu_meet() -> None:
    def info(boot: str, device: str, *cpus: int, gpus: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
        return wire.model_info_from_proto(common_pb2.ModelInfo(device=device, boot_id=boot, cpu_ids=cpus,
                                                               accelerator_ids=gpus))

    assert info("a", "cpu", 0, 1).cpu_ids == frozenset({0, 1})  # the fields cross the wire
    assert shares_compute(info("a", "cpu", 0, 1), info("a", "cpu", 1))
    assert not shares_compute(info("a", "cpu", 0), info("a", "cpu", 1))  # pinned apart
    assert not shares_compute(info("a", "cpu", 0), info("b", "cpu", 0))  # two machines
    assert not shares_compute(info("", "cpu", 0), info("", "cpu", 0))  # unknown: apart
    assert shares_compute(info("a", "cuda:0", 0, gpus=("GPU-1",)), info("a", "cuda:1", 1, gpus=("GPU-1", "GPU-2")))
    # Two pods on one node, each with a GPU of its own that it calls cuda:0:
    assert not shares_compute(info("a", "cuda:0", 0, gpus=("GPU-1",)), info("a", "cuda:0", 0, gpus=("GPU-2",)))
    assert not shares_compute(info("a", "cuda:0", 0), info("a", "cuda:0", 0))  # GPUs not known: apart
    assert not shares_compute(info("a", "cuda:0", 0, gpus=("GPU-1",)), info("a", "cpu", 0))  # a CPU draft by a GPU target
