"""End to end on the real default pair (Qwen2.5-Coder 0.5B draft, 1.5B target), through the README's commands.

`tandem up` starts three processes; `tandem generate --json` asks the orchestrator;
the tokens must equal the target's own greedy generate() in float32.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
from fakes import Output, stop
from tiny import greedy_reference, speculated

from tandem import llama, models
from tandem.client import TandemClient
from tandem.launch import Stack, start_stack

# Loading the 1.5B target (here and in `tandem up`) takes minutes on a CPU: more than the
# suite's per-test timeout allows the first test, whose setup does both.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

PROMPTS = ["def fibonacci(n):", "The three primary colours are"]
LENGTH = 24


@pytest.fixture(scope="module")
def references() -> dict[str, list[int]]:
    from transformers import AutoTokenizer

    path = models.resolve(models.DEFAULT_TARGET, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    refs = {p: greedy_reference(path, tokenizer.encode(p), LENGTH, matmul_path="onednn")
            for p in PROMPTS}
    gc.collect()
    return refs


@pytest.fixture(scope="module")
def tandem_up(references: dict[str, list[int]], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`tandem up` on port 0; the address is read back from its ready line. The target on
    transformers in float32 on oneDNN's packed kernels, as the references are (auto would pick
    llama.cpp where it is installed, bfloat16 on a CPU with bf16 instructions, and the matmul
    path by timing)."""
    logs = tmp_path_factory.mktemp("logs")
    proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", "up", "--port", "0", "--http-port", "0",
                             "--dtype", "float32", "--matmul", "onednn", "--target-backend", "transformers",
                             "--log-dir", str(logs)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own group: killed with its services below
    assert proc.stdout is not None
    try:
        ready = Output(proc.stdout).wait_for("Tandem is ready", timeout=1800)
        yield ready.rsplit(" ", 1)[1].strip()
        stop(proc, timeout=120)  # SIGTERM: it stops its services; killed if it hangs
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def generate(address: str, prompt: str, *flags: str) -> dict:  # type: ignore[type-arg]
    out = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "generate", prompt, "--address", address,
         "--max-new-tokens", str(LENGTH), "--json", *flags],
        capture_output=True, text=True, timeout=600, check=True)
    reply: dict = json.loads(out.stdout)  # type: ignore[type-arg]
    return reply


@pytest.mark.parametrize("prompt", PROMPTS)
def test_real_pair_greedy_equals_target_generate(tandem_up: str, references: dict[str, list[int]],
                                                 prompt: str) -> None:
    """As the README runs it: the server's own speculation policy, which may choose k = 0."""
    reply = generate(tandem_up, prompt)
    assert reply["token_ids"] == references[prompt]
    assert reply["usage"]["completion_tokens"] == LENGTH


@pytest.mark.parametrize("prompt", PROMPTS)
def test_real_pair_speculation_saves_target_passes(tandem_up: str, references: dict[str, list[int]],
                                                   prompt: str) -> None:
    """With k fixed at 4, every step drafts; that the 0.5B draft matches the 1.5B target's
    greedy choice at least once in 24 tokens is a property of this pair, not of a policy."""
    with TandemClient(tandem_up) as client:
        tokens, usage = speculated(client, prompt, LENGTH, 4)  # every step drafted 4, no fallback
    assert tokens == references[prompt]
    assert usage.accepted_tokens > 0
    assert usage.target_forward_passes < LENGTH  # speculation saved target passes


# --- the target's own GGUF file on llama.cpp ------------------------------------------------


@pytest.fixture(scope="module")
def llama_stack() -> Iterator[Stack]:
    if not llama.available():
        pytest.skip("llama-cpp-python is not installed")
    stack = start_stack(models.DEFAULT_DRAFT, models.DEFAULT_TARGET, threads=0,
                        draft_args=["--backend", "llama.cpp"], target_args=["--backend", "llama.cpp"])
    yield stack
    stack.stop()


def llama_greedy(ids: list[int], length: int) -> tuple[list[int], list[float]]:
    """llama.cpp's own greedy decoding of the target file, one token a pass, in this process;
    and the gap between the top two logits at each token."""
    from tandem.batching import Pass
    from tandem.kv import KVSession

    path = models.find_gguf(models.DEFAULT_TARGET)
    engine = llama.LlamaEngine(str(path), context_tokens=1024, max_batch_tokens=64, threads=1)
    try:
        session = KVSession("reference", engine.vocab_size, new_cache=engine.new_cache)
        logits = engine.single(Pass(session, 0, tuple(ids))).logits[-1]
        tokens, gaps = [], []
        for i in range(length):
            top = logits.topk(2).values
            tokens.append(int(logits.argmax()))
            gaps.append(float(top[0] - top[1]))
            logits = engine.single(Pass(session, len(ids) + i, (tokens[-1],))).logits[-1]
        return tokens, gaps
    finally:
        engine.close()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_the_llama_target_decodes_as_llama_cpp_does_and_speculation_parts_only_at_near_ties(
        llama_stack: Stack, prompt: str) -> None:
    """k = 0 through the services is llama.cpp's own one-token decoding of the file, token for
    token. k = 4 scores blocks, whose rows llama.cpp rounds differently (docs/ARCHITECTURE.md,
    "Exact on llama.cpp"): its output follows k = 0's up to a token where k = 0's top two
    logits were within that rounding, if it parts at all."""
    ids = models.load_tokenizer(models.DEFAULT_TARGET).encode(prompt)
    reference, gaps = llama_greedy(ids, LENGTH)
    with llama_stack.client() as client:
        alone = list(client.generate(ids, max_new_tokens=LENGTH, num_speculative_tokens=0,
                                     ignore_eos=True).token_ids)
        tokens, usage = speculated(client, ids, LENGTH, 4)
    assert alone == reference
    parted = next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=True)) if a != b), None)
    assert parted is None or gaps[parted] < 1.0, (parted, gaps)  # twice the 0.5 a logit moved
    assert usage.accepted_tokens > 0


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "languages"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "languages": {"type": "array", "items": {"type": "string"}}}}


def test_schema_replies_parse_validate_and_carry_the_files_logprobs(llama_stack: Stack) -> None:
    """The built-in pair under a JSON schema, greedy and sampled, with speculation at k = 4: the
    replies parse, have the schema's fields and types, and end by EOS; tokens were drafted and
    accepted. Each token's log-probability is llama.cpp's own: decoding alone (k = 0, one token a
    pass) within 1e-2 of its one-token passes over the file; speculating, within the rounding by
    which a block's rows part from one-token rows on quantized kernels (0.5, as above)."""
    import grpc
    import torch

    from tandem.batching import Pass
    from tandem.kv import KVSession
    from tandem.v1 import common_pb2, orchestrator_pb2

    tokenizer = models.load_tokenizer(models.DEFAULT_TARGET)
    ids = list(tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe a fictional engineer as JSON: name, age, languages."}],
        add_generation_prompt=True, return_dict=False))
    grammar = common_pb2.Grammar(json_schema=json.dumps(SCHEMA))
    with llama_stack.client() as client:
        # First: a fresh prompt, whose KV no other pass computed (a prefix cache would hand the
        # later requests KV that blocks computed, rounded as blocks round).
        alone = client.generate(ids, max_new_tokens=80, num_speculative_tokens=0, grammar=grammar, logprobs=2)
        replies = [client.generate(ids, max_new_tokens=80, num_speculative_tokens=4, proposer="draft-model",
                                   grammar=grammar, logprobs=2, temperature=temperature, seed=5)
                   for temperature in (0.0, 0.8)]
        with pytest.raises(grpc.RpcError) as bad:
            client.generate(ids, max_new_tokens=8, grammar=common_pb2.Grammar(json_schema='{"type": 5}'))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "grammar.json_schema" in bad.value.details()
    for reply in (*replies, alone):
        value = json.loads(reply.text)
        assert set(value) == {"name", "age", "languages"} and isinstance(value["age"], int)
        assert all(isinstance(v, str) for v in value["languages"])
        assert reply.finish_reason == orchestrator_pb2.FINISH_REASON_EOS
    for reply in replies:
        assert reply.usage.accepted_tokens > reply.usage.grammar_forced_tokens > 0
    # Configured as the target service runs it (its batch size and threads), in this process.
    engine = llama.LlamaEngine(str(models.find_gguf(models.DEFAULT_TARGET)), context_tokens=4096,
                               max_batch_tokens=512, threads=0)
    try:
        for reply, tolerance in ((alone, 1e-2), (replies[0], 0.5)):
            tokens = list(reply.token_ids)
            session = KVSession("lp", engine.vocab_size, new_cache=engine.new_cache)
            rows = [engine.single(Pass(session, 0, tuple(ids))).logits[-1]]
            rows += [engine.single(Pass(session, len(ids) + i, (t,))).logits[-1] for i, t in enumerate(tokens[:-1])]
            want = torch.log_softmax(torch.stack(rows).float(), -1)[torch.arange(len(tokens)), torch.tensor(tokens)]
            got = torch.tensor([t.logprob for t in reply.logprobs])
            torch.testing.assert_close(got, want, atol=tolerance, rtol=0)
    finally:
        engine.close()
