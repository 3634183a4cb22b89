"""The `tandem` command as a newcomer meets it: help, refusals, Ctrl-C, a missing model, and
client commands that never load torch."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from replicas import replica_state, wait_for_baseline

from tandem.cli import build_parser
from tandem.launch import Stack, start_stack

pytestmark = pytest.mark.slow  # tandem up and stacks of real processes (CI runs it)


def _generate_parser() -> argparse.ArgumentParser:
    parser = build_parser(only="generate")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["generate"]  # type: ignore[no-any-return]


def test_every_generate_option_has_help_and_the_numbers_say_their_default() -> None:
    actions = [a for a in _generate_parser()._actions if a.option_strings and a.dest != "help"]
    assert actions
    for action in actions:
        assert action.help, f"{action.option_strings} has no help text"
    helps = {a.dest: a.help or "" for a in actions}
    for dest in ("address", "max_new_tokens", "temperature", "top_p", "top_k", "seed"):
        assert "default" in helps[dest], f"--{dest} does not say its default: {helps[dest]!r}"
    assert "TANDEM_ADDRESS" in helps["address"]


@pytest.mark.parametrize("flag,value", [
    ("--max-new-tokens", "0"), ("--max-new-tokens", "-1"), ("--max-new-tokens", str(2**32)),
    ("--temperature", "-0.5"), ("--temperature", "nan"), ("--temperature", "inf"),
    ("--top-p", "0"), ("--top-p", "1.5"), ("--top-k", "-1"), ("--seed", "-1"),
    ("--num-speculative-tokens", "-1"), ("--max-new-tokens", "ten"),
])
def test_generate_refuses_what_it_cannot_send_and_names_the_flag(
        flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: --max-new-tokens 0 silently meant the default, and -1 reached the wire as
    # "Value out of range: -1" with no flag named.
    with pytest.raises(SystemExit) as exit_:
        build_parser(only="generate").parse_args(["generate", "x", flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: " in capsys.readouterr().err


def test_generate_accepts_the_edges_of_each_range() -> None:
    args = build_parser(only="generate").parse_args(
        ["generate", "x", "--max-new-tokens", "1", "--temperature", "0", "--top-p", "1",
         "--top-k", "0", "--seed", str(2**64 - 1), "--num-speculative-tokens", "0"])
    assert (args.max_new_tokens, args.top_p, args.seed) == (1, 1.0, 2**64 - 1)


CHECK_MODULES = """
import json, sys
from tandem.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps({m: m in sys.modules for m in ("torch", "transformers")}), file=sys.stderr)
"""


def _modules_loaded(argv: list[str]) -> dict[str, bool]:
    result = subprocess.run([sys.executable, "-c", CHECK_MODULES, *argv], capture_output=True,
                            text=True, timeout=120, check=False)
    return json.loads(result.stderr.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_client_commands_import_neither_torch_nor_transformers(tiny_stack: Stack) -> None:
    # Help used to take seconds: every command's config imported torch to build the parser.
    assert _modules_loaded(["--help"]) == {"torch": False, "transformers": False}
    assert _modules_loaded(["generate", "--help"]) == {"torch": False, "transformers": False}
    assert _modules_loaded(["generate", "ab", "--address", tiny_stack.address,
                            "--max-new-tokens", "2"]) == {"torch": False, "transformers": False}


def test_ctrl_c_cancels_the_call_frees_the_caches_and_exits_130_quietly(tiny_stack: Stack) -> None:
    baseline = replica_state(tiny_stack)
    client = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "generate", "hello", "--address", tiny_stack.address,
         "--ignore-eos", "--max-new-tokens", "400", "--num-speculative-tokens", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    target = tiny_stack.targets[0].proc
    try:
        assert client.stdout is not None
        assert client.stdout.read(1)  # a delta was printed: the stream is generating
        # Hold the target still, so the stream cannot reach its end before the interrupt.
        target.send_signal(signal.SIGSTOP)
        client.send_signal(signal.SIGINT)
        _, err = client.communicate(timeout=60)
    finally:
        target.send_signal(signal.SIGCONT)
        if client.poll() is None:
            client.kill()
            client.wait()
    assert client.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    wait_for_baseline(tiny_stack, baseline)  # the cancelled call's sessions and KV are freed


def test_a_model_path_that_does_not_exist_is_refused_in_one_line_before_listening(
        tmp_path: Path) -> None:
    missing = tmp_path / "does-not-exist"
    result = subprocess.run([sys.executable, "-m", "tandem.cli", "target-service", "--model",
                             str(missing)], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 1
    assert "listening on" not in result.stdout + result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert str(missing) in result.stderr and "does not exist" in result.stderr


def test_a_hub_id_that_cannot_be_fetched_is_refused_in_one_line(tmp_path: Path) -> None:
    # Whether this machine reaches the hub or not (the id does not exist there either), the
    # answer is one line naming the id, and no server starts.
    env = {**os.environ, "HF_HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "tandem.cli", "draft-service", "--model",
                             "tandem-tests/no-such-model"], capture_output=True, text=True,
                            timeout=120, check=False, env=env)
    assert result.returncode == 1
    assert "listening on" not in result.stdout + result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "'tandem-tests/no-such-model'" in result.stderr


def test_the_eos_ids_are_the_union_of_config_generation_config_and_tokenizer(tmp_path: Path) -> None:
    from tiny import make_model, make_tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from tandem.models import eos_token_ids

    # A converted Qwen2.5 listed only <|im_end|> in its generation config, so the first demo
    # ran on past <|endoftext|>, which its config declares.
    path = make_model(tmp_path / "m", seed=0, eos_token_id=3)
    model = AutoModelForCausalLM.from_pretrained(path)
    model.generation_config = GenerationConfig(eos_token_id=[4, 5])  # type: ignore[no-untyped-call]
    tokenizer = AutoTokenizer.from_pretrained(path)  # its EOS is id 0
    assert eos_token_ids(model, tokenizer) == [0, 3, 4, 5]
    assert make_tokenizer().eos_token_id == 0


def test_a_draft_that_refuses_the_requests_ids_is_logged_as_such_and_output_stays_exact(
        tmp_path: Path, tiny_target: Path, reference) -> None:  # type: ignore[no-untyped-def]
    from tiny import make_model

    # The draft's 10 output rows are fewer than the tokenizer's 36 ids: it refuses a prompt
    # holding a larger id, and the request goes on with the target alone. The log used to
    # say "no draft replica left", which sends an operator looking for a dead replica.
    small = make_model(tmp_path / "small-draft", seed=3, vocab_size=10)
    stack = start_stack(str(small), str(tiny_target))
    try:
        with stack.client() as client:
            reply = client.generate("hello world", max_new_tokens=12, num_speculative_tokens=2)
        assert list(reply.token_ids) == reference("hello world", 12)
        deadline = time.monotonic() + 30
        while not any("the draft refused this request" in line for line in stack.orchestrator.lines):
            assert time.monotonic() < deadline, "".join(stack.orchestrator.lines)
            time.sleep(0.05)
        assert not any("no draft replica left" in line for line in stack.orchestrator.lines)
    finally:
        stack.stop()


def test_tandem_up_says_where_its_logs_are_and_that_it_stops(
        tmp_path: Path, tiny_draft: Path, tiny_target: Path) -> None:
    # It used to swallow the services' logs and print nothing on the way out.
    logs = tmp_path / "logs"
    up = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "up", "--draft", str(tiny_draft), "--target",
         str(tiny_target), "--port", "0", "--http-port", "0", "--dtype", "float32",
         "--log-dir", str(logs)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert up.stdout is not None
        for line in up.stdout:
            lines.append(line)
            if line.startswith("Tandem is ready"):
                break
        assert any(line.startswith("Tandem is ready") for line in lines), "".join(lines)
        assert any(str(logs) in line for line in lines)
        for role in ("draft", "target", "orchestrator"):
            assert any(line.strip().startswith(f"{role} ready") for line in lines), "".join(lines)
            assert "listening on" in (logs / f"{role}.log").read_text()
        up.send_signal(signal.SIGINT)
        rest, _ = up.communicate(timeout=120)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert "stopping..." in rest and rest.rstrip().endswith("stopped"), rest
    assert "Traceback" not in rest
