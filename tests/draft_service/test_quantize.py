"""`--quantize int8-dynamic`: a cheaper draft that changes its proposals, never the output.

The quantized draft runs as a real process behind a real orchestrator. Its distributions
differ from the float32 draft's (so the flag took effect), yet greedy output equals the
target's own generate(). The target service refuses the flag, and a draft refuses it
outside CPU float32.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from tiny import PROMPTS, make_tokenizer, speculated
from transformers import AutoModelForCausalLM

from tandem import batching, sampling
from tandem.launch import Stack, spawn, start_stack, wait_serving
from tandem.model_service import ModelHost, ModelServiceConfig
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc

pytestmark = pytest.mark.slow  # a stack of real processes per test (CI runs it)

LENGTH = 40
SUPPORT = 8


@pytest.fixture(scope="module")
def quantized_stack(tiny_draft: Path, tiny_target: Path) -> Iterator[Stack]:
    stack = start_stack(str(tiny_draft), str(tiny_target), draft_args=["--quantize", "int8-dynamic"])
    yield stack
    stack.stop()


def float_draft_distribution(draft: Path, prompt: list[int]) -> sampling.SparseDistribution:
    """The float32 draft's q after `prompt` at temperature 1, truncated to SUPPORT tokens."""
    model = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0, -1:]
    support, probs = sampling.truncate(sampling.probabilities(logits, sampling.SamplingParams(1.0))[0],
                                       SUPPORT)
    return sampling.SparseDistribution(tuple(support.tolist()), tuple(probs.tolist()))


def test_the_quantized_draft_proposes_differently(quantized_stack: Stack, tiny_draft: Path) -> None:
    prompt = make_tokenizer().encode(PROMPTS[0])
    with grpc.insecure_channel(quantized_stack.drafts[0].address) as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        info = stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=30).info
        [reply] = list(stub.ProposeBlocks(iter([draft_pb2.ProposeBlocksRequest(
            new_token_ids=prompt, num_speculative_tokens=1, max_support_size=SUPPORT,
            sampling=common_pb2.SamplingParams(temperature=1.0), seed=1)]), timeout=30))
    assert info.dtype == "float32+int8-dynamic"
    quantized = dict(zip(reply.distributions[0].token_ids, reply.distributions[0].probs, strict=True))
    reference = float_draft_distribution(tiny_draft, prompt)
    floated = dict(zip(reference.token_ids, reference.probs, strict=True))
    # Same model, int8 weights: close to the float32 draft's q, but not equal to it.
    assert quantized.keys() & floated.keys()
    gaps = [abs(quantized.get(t, 0.0) - floated.get(t, 0.0)) for t in quantized.keys() | floated.keys()]
    assert 1e-5 < max(gaps) < 0.5


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_output_with_a_quantized_draft_equals_target_generate(
        quantized_stack: Stack, reference, prompt: str) -> None:  # type: ignore[no-untyped-def]
    with quantized_stack.client() as client:
        tokens, usage = speculated(client, prompt, LENGTH, 4)  # every step drafted 4
    assert tokens == reference(prompt, LENGTH)
    assert usage.accepted_tokens > 0  # int8 weights keep the draft close to the target


def test_the_target_service_refuses_quantize(tiny_target: Path) -> None:
    with pytest.raises(RuntimeError) as err:
        spawn(["target-service", "--model", str(tiny_target), "--quantize", "int8-dynamic"])
    assert "exited with 1" in str(err.value)
    assert "--quantize is for drafts only" in str(err.value)


def test_a_draft_refuses_quantize_outside_cpu_float32(tiny_draft: Path) -> None:
    process = spawn(["draft-service", "--model", str(tiny_draft), "--quantize", "int8-dynamic",
                     "--dtype", "bfloat16", "--threads", "1"])
    try:
        with pytest.raises(RuntimeError) as err:
            wait_serving(process, timeout=120)
    finally:
        process.stop()
    assert "int8-dynamic" in str(err.value) and "float32" in str(err.value)
    assert process.proc.returncode != 0


def test_a_quantized_draft_shares_passes(tiny_draft: Path) -> None:
    """int8-dynamic scales each pass's activations as one tensor, so the start-up probe, run on
    the quantized model, would see sessions' q move with their pass-mates and keep one
    session per pass (every guess of drafting ahead in a pass of its own). It probes the
    float weights, the architecture, instead; the quantized draft batches."""
    host = ModelHost(ModelServiceConfig(model=str(tiny_draft), quantize="int8-dynamic", threads=1))
    host.load()
    assert host.info is not None and host.info.dtype == "float32+int8-dynamic"
    assert host.batch_refusal is None
    assert host.scheduler.max_sessions == ModelServiceConfig.max_batch_sessions > 1
    # What the probe would have said of the quantized model itself: the reason for the above.
    assert host.model is not None and batching.batching_refusal(host.model) is not None
