"""The tokenizer comes from the target: GetTokenizer serves its files, chat template included,
and an orchestrator started without --tokenizer loads them, with no model of its own.

Real processes on a tiny random model; the target's tokenizer is given a chat template.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from tiny import PROMPTS, make_tokenizer

from tandem import models
from tandem.launch import Process, Stack, spawn, wait_serving
from tandem.v1 import common_pb2, target_pb2, target_pb2_grpc

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")

pytestmark = pytest.mark.slow  # stacks of its own (CI runs it)


@pytest.fixture(scope="module")
def chat_target(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    """A target serving the tiny target, its tokenizer given a chat template (same token ids)."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("chat") / "target"
    shutil.copytree(tiny_target, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    target = spawn(["target-service", "--model", str(path), "--threads", "1"])
    try:
        wait_serving(target)
        yield target
    finally:
        target.stop()


def test_the_target_serves_its_tokenizer_and_chat_template(chat_target: Process) -> None:
    with grpc.insecure_channel(chat_target.address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        reply = stub.GetTokenizer(target_pb2.GetTokenizerRequest(), timeout=30)
        info = stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=30).info
    assert all(f.name and "/" not in f.name for f in reply.files)
    tokenizer = models.tokenizer_from_files(
        tuple(models.TokenizerFile(f.name, f.content) for f in reply.files))
    assert models.tokenizer_fingerprint(tokenizer) == info.tokenizer_fingerprint
    assert tokenizer.chat_template == CHAT_TEMPLATE
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered == "<user>hi\n<assistant>"
    assert tokenizer.encode(PROMPTS[0]) == make_tokenizer().encode(PROMPTS[0])


@pytest.mark.parametrize("name", ["../escape", "a/b", "", ".."])
def test_a_file_name_that_is_not_plain_is_refused(name: str) -> None:
    with pytest.raises(models.ModelError, match="not a plain file name"):
        models.tokenizer_from_files((models.TokenizerFile(name, b"{}"),))


def test_an_orchestrator_without_tokenizer_needs_no_model_of_its_own(
        chat_target: Process, tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    """Empty model caches stay empty: the tokenizer came over gRPC, into a temporary directory."""
    caches = {"TANDEM_CACHE_DIR": tmp_path / "tandem", "HF_HOME": tmp_path / "hf",
              "XDG_CACHE_HOME": tmp_path / "xdg"}
    for directory in caches.values():
        directory.mkdir()
    orchestrator = spawn(["orchestrator", "--target", chat_target.address],
                         env={name: str(path) for name, path in caches.items()})
    try:
        wait_serving(orchestrator, timeout=120)
        with Stack([], [chat_target], orchestrator).client() as client:
            reply = client.generate(PROMPTS[0], max_new_tokens=12, ignore_eos=True)
    finally:
        orchestrator.stop()
    assert list(reply.token_ids) == reference(PROMPTS[0], 12)
    assert reply.text == make_tokenizer().decode(reply.token_ids)
    left = [p for directory in caches.values() for p in directory.rglob("*")]
    assert left == [], f"the orchestrator wrote into its caches: {left}"
