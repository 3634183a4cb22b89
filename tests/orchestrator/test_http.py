"""The OpenAI-compatible HTTP API through the official `openai` SDK (sync and async) and raw
HTTP, against a real orchestrator and real replicas on tiny random models."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import openai
import pytest
from replicas import replica_state, wait_for_baseline

from tandem.launch import Stack, start_stack

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
PROMPT = "def fib(n):"

pytestmark = pytest.mark.slow  # stacks of its own (CI runs it)


@pytest.fixture(scope="module")
def chat_target(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny target, its tokenizer given a chat template (the token ids are unchanged)."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("chat") / "target"
    shutil.copytree(tiny_target, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def stack(tiny_draft: Path, chat_target: Path) -> Iterator[Stack]:
    metrics = ["--metrics-port", "0"]
    stack = start_stack(str(tiny_draft), str(chat_target), draft_args=metrics,
                        target_args=metrics, orchestrator_args=["--http-port", "0"])
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=stack.orchestrator.wait_http_url() + "/v1", api_key="unused",
                       max_retries=0) as client:
        yield client


def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_models_lists_the_target_and_health_is_ok(stack: Stack, client: openai.OpenAI,
                                                 chat_target: Path) -> None:
    models = client.models.list().data
    assert len(models) == 1 and models[0].id == str(chat_target)
    status, body = raw(stack, "GET", "/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}


def test_greedy_completion_equals_the_grpc_api(stack: Stack, client: openai.OpenAI) -> None:
    reply = client.completions.create(model=model_name(client), prompt=PROMPT, max_tokens=24,
                                      temperature=0, extra_body={"ignore_eos": True})
    with stack.client() as grpc_client:
        expected = grpc_client.generate(PROMPT, max_new_tokens=24, ignore_eos=True)
    assert reply.choices[0].text == expected.text
    assert reply.choices[0].finish_reason == "length"
    assert reply.object == "text_completion"
    usage = reply.usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(PROMPT), 24)
    assert usage.total_tokens == len(PROMPT) + 24
    extra = usage.model_extra or {}
    assert extra["drafted_tokens"] >= extra["accepted_tokens"] >= 0
    assert extra["drafted_tokens"] >= extra["suffix_drafted_tokens"] >= extra["suffix_accepted_tokens"] >= 0
    assert extra["proposer"] == "auto"  # the default where draft replicas exist


def test_streamed_completion_equals_the_whole_one_and_carries_usage(client: openai.OpenAI) -> None:
    body = {"model": model_name(client), "prompt": PROMPT, "max_tokens": 20, "temperature": 0,
            "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**body)  # type: ignore[call-overload]
    chunks = list(client.completions.create(**body, stream=True,  # type: ignore[call-overload]
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_chat_uses_the_tokenizers_template(stack: Stack, client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "hello world"}]
    reply = client.chat.completions.create(model=model_name(client), messages=messages,  # type: ignore[arg-type]
                                           max_completion_tokens=16, temperature=0,
                                           extra_body={"ignore_eos": True})
    rendered = "user: hello world\nassistant:"
    with stack.client() as grpc_client:
        expected = grpc_client.generate(rendered, max_new_tokens=16, ignore_eos=True)
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected.text
    streamed = list(client.chat.completions.create(
        model=model_name(client), messages=messages, max_tokens=16, temperature=0,  # type: ignore[arg-type]
        stream=True, extra_body={"ignore_eos": True}))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected.text
    assert streamed[-1].choices[0].finish_reason == "length"


def test_a_later_turn_reports_the_prompt_tokens_its_prefix_cache_served(client: openai.OpenAI) -> None:
    name = model_name(client)
    messages = [{"role": "system", "content": "you answer in code, tersely, and never twice the same"},
                {"role": "user", "content": "fib please"}]
    first = client.chat.completions.create(model=name, messages=messages, max_completion_tokens=12,  # type: ignore[arg-type]
                                           temperature=0, extra_body={"ignore_eos": True})
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                 {"role": "user", "content": "again"}]
    for _ in range(50):  # the first turn's sessions close just after its reply
        second = client.chat.completions.create(model=name, messages=messages, max_completion_tokens=4,  # type: ignore[arg-type]
                                                temperature=0, extra_body={"ignore_eos": True})
        assert second.usage is not None and second.usage.prompt_tokens_details is not None
        if second.usage.prompt_tokens_details.cached_tokens:
            break
        time.sleep(0.1)
    # At least the first turn's prompt (this template writes "assistant: " before a message it
    # is given, where the reply followed "assistant:": the reply itself is not a common prefix).
    assert first.usage.prompt_tokens <= second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens


def test_n_choices_come_indexed_whole_and_streamed(client: openai.OpenAI) -> None:
    name = model_name(client)
    reply = client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0, n=3,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.text for c in reply.choices}) == 1  # greedy: the same three times
    assert reply.usage is not None and reply.usage.completion_tokens == 24
    assert reply.usage.prompt_tokens == len(PROMPT)
    chunks = list(client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=1.0,
        seed=5, n=2, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    texts = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert all(texts.values())
    ends = [c.choices[0].finish_reason for c in chunks[:-1] if c.choices and c.choices[0].finish_reason]
    assert ends == ["length", "length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_stop_strings_and_seeds(client: openai.OpenAI) -> None:
    name = model_name(client)
    text = client.completions.create(model=name, prompt=PROMPT, max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = text[10:12]
    cut = client.completions.create(model=name, prompt=PROMPT, max_tokens=40, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    sampled = [client.completions.create(model=name, prompt=PROMPT, max_tokens=24, temperature=1,
                                         seed=7, extra_body={"num_speculative_tokens": 2,
                                                             "ignore_eos": True}).choices[0].text
               for _ in range(2)]
    assert sampled[0] == sampled[1]


@pytest.mark.parametrize("body,param", [
    ({"n": 17}, "n"),  # past --max-choices
    ({"n": 0}, "n"),
    ({"best_of": 2}, "best_of"),
    ({"temperature": -1}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": 21}, "logprobs"),  # past OpenAI's 20
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}},
     "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_regex": "[a-z]+", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"max_token": 5}, "max_token"),
    ({"proposer": "medusa"}, None),  # the tiny target has no heads
])
def test_bad_parameters_are_400_naming_the_field(client: openai.OpenAI, body: dict[str, object],
                                                 param: str | None) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model_name(client), prompt=PROMPT, max_tokens=4,
                                  extra_body=body)
    assert err.value.status_code == 400
    assert (err.value.body or {}).get("param") == param  # type: ignore[union-attr]
    assert (param or "medusa") in err.value.message
    # ...and the next request is served.
    assert client.completions.create(model=model_name(client), prompt=PROMPT, max_tokens=2,
                                     temperature=0).usage.completion_tokens == 2  # type: ignore[union-attr]


def test_an_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="not-this-one", prompt=PROMPT, max_tokens=2)
    assert "not-this-one" in err.value.message


def raw(stack: Stack, method: str, path: str, body: dict[str, object] | None = None,
        headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    url = urlsplit(stack.orchestrator.wait_http_url())
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        connection.request(method, path, body=json.dumps(body) if body is not None else None,
                           headers={"content-type": "application/json", **(headers or {})})
        reply = connection.getresponse()
        return reply.status, reply.read()
    finally:
        connection.close()


def test_the_event_stream_is_framed_as_openai_frames_it(stack: Stack) -> None:
    status, body = raw(stack, "POST", "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True}})
    assert status == 200
    assert body.endswith(b"data: [DONE]\n\n")
    events = body.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    payloads = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
    assert all(e.startswith(b"data: {") for e in events[:-2])
    assert len({p["id"] for p in payloads}) == 1
    assert all(p["object"] == "text_completion" for p in payloads)
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 6
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"
    assert all(p["usage"] is None for p in payloads[:-1])


def test_a_client_that_disconnects_mid_stream_frees_both_replicas(stack: Stack) -> None:
    baseline = replica_state(stack)
    url = urlsplit(stack.orchestrator.wait_http_url())
    with socket.create_connection((url.hostname, url.port), timeout=60) as sock:
        body = json.dumps({"prompt": PROMPT, "max_tokens": 400, "stream": True,
                           "ignore_eos": True, "num_speculative_tokens": 2}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                     b"application/json\r\ncontent-length: " + str(len(body)).encode() +
                     b"\r\n\r\n" + body)
        received = b""
        while b"data: {" not in received:  # generating
            received += sock.recv(4096)
        target = stack.targets[0].proc
        target.send_signal(signal.SIGSTOP)  # the stream cannot finish before the client leaves
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.close()
            time.sleep(0.5)
            target.send_signal(signal.SIGCONT)
    wait_for_baseline(stack, baseline)


def test_the_async_client_streams_too(client: openai.OpenAI) -> None:
    async def scenario() -> str:
        async with openai.AsyncOpenAI(base_url=str(client.base_url), api_key="unused",
                                      max_retries=0) as aclient:
            stream = await aclient.completions.create(model=model_name(client), prompt=PROMPT,
                                                      max_tokens=12, temperature=0, stream=True)
            return "".join([c.choices[0].text async for c in stream if c.choices])

    whole = client.completions.create(model=model_name(client), prompt=PROMPT, max_tokens=12,
                                      temperature=0).choices[0].text
    assert asyncio.run(scenario()) == whole


def test_a_full_orchestrator_is_429(tiny_target: Path) -> None:
    stack = start_stack(None, str(tiny_target), orchestrator_args=[
        "--http-port", "0", "--max-concurrent-requests", "1", "--max-queued-requests", "0"])
    try:
        base = stack.orchestrator.wait_http_url() + "/v1"
        with openai.OpenAI(base_url=base, api_key="x", max_retries=0) as client:
            stream = client.completions.create(model=model_name(client), prompt=PROMPT,
                                               max_tokens=200, stream=True,
                                               extra_body={"ignore_eos": True})
            next(iter(stream))  # one request holds the only slot
            stack.targets[0].proc.send_signal(signal.SIGSTOP)
            try:
                with pytest.raises(openai.RateLimitError) as err:
                    client.completions.create(model=model_name(client), prompt=PROMPT,
                                              max_tokens=2)
                assert "--max-concurrent-requests" in err.value.message
            finally:
                stack.targets[0].proc.send_signal(signal.SIGCONT)
                stream.close()
    finally:
        stack.stop()


def test_without_the_bearer_token_is_401(tiny_target: Path, tmp_path: Path) -> None:
    (tmp_path / "token").write_text("s3cret\n")
    stack = start_stack(None, str(tiny_target), orchestrator_args=[
        "--http-port", "0", "--auth-token-file", str(tmp_path / "token")], token="s3cret")
    try:
        base = stack.orchestrator.wait_http_url() + "/v1"
        with openai.OpenAI(base_url=base, api_key="wrong", max_retries=0) as client, \
                pytest.raises(openai.AuthenticationError):
            client.completions.create(model="", prompt=PROMPT, max_tokens=2)
        with openai.OpenAI(base_url=base, api_key="s3cret", max_retries=0) as client:
            assert client.completions.create(model="", prompt=PROMPT, max_tokens=2,
                                             temperature=0).usage.completion_tokens == 2  # type: ignore[union-attr]
    finally:
        stack.stop()


def test_while_loading_it_is_503(tiny_target: Path) -> None:
    # The orchestrator waits for a target that is not there yet: gRPC and HTTP listen, and
    # both say it is not ready.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        missing = f"127.0.0.1:{s.getsockname()[1]}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "orchestrator", "--target", missing, "--port", "0",
         "--http-port", "0", "--tokenizer", str(tiny_target)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        url = ""
        for line in proc.stdout:
            if " http on " in line:
                url = "http://" + line.rsplit(" ", 1)[1].strip()
                break
        assert url, "no http line"
        with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client, \
                pytest.raises(openai.InternalServerError) as err:
            client.completions.create(model="", prompt=PROMPT, max_tokens=2)
        assert err.value.status_code == 503
    finally:
        proc.kill()
        proc.wait()


def test_structured_output_and_logprobs_over_http(client: openai.OpenAI) -> None:
    """A regex (vLLM's guided_regex) shapes the reply; chat returns each token's log-probability
    with its top tokens; a JSON object the tiny vocabulary cannot spell (no braces) ends at
    once with its own finish reason, never a hang."""
    name = model_name(client)
    reply = client.completions.create(model=name, prompt=PROMPT, max_tokens=30, temperature=0,
                                      logprobs=2, extra_body={"guided_regex": "(yes|no), [a-z]{2,8}\\."})
    choice = reply.choices[0]
    assert re.fullmatch(r"(yes|no), [a-z]{2,8}\.", choice.text), choice.text
    assert choice.logprobs is not None and "".join(choice.logprobs.tokens or []) == choice.text
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs or [])
    chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=6, logprobs=True, top_logprobs=3,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 6
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 3 for t in content)
    streamed = client.completions.create(model=name, prompt=PROMPT, max_tokens=30, temperature=0, logprobs=1,
                                         stream=True, extra_body={"guided_regex": "(yes|no), [a-z]{2,8}\\."})
    chunks = [c.choices[0] for c in streamed if c.choices]
    tokens = [t for c in chunks if c.logprobs is not None for t in c.logprobs.tokens or []]
    assert "".join(tokens) == "".join(c.text for c in chunks) == choice.text
    dead = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=6, response_format={"type": "json_object"})
    assert dead.choices[0].finish_reason == "grammar_dead_end"  # type: ignore[comparison-overlap]
    assert dead.choices[0].message.content == ""
