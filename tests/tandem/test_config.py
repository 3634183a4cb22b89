"""Flags and their TANDEM_* variables: a bad value is named, and only the command using it fails."""

from __future__ import annotations

import pytest

from tandem.cli import build_parser


def test_a_bad_variable_does_not_break_other_commands(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_GRACE_S", "30s")
    monkeypatch.setenv("TANDEM_PORT", "")
    args = build_parser().parse_args(["generate", "def f():"])
    assert args.prompt == "def f():"


def test_a_bad_variable_is_named_by_the_command_that_reads_it(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TANDEM_GRACE_S", "30s")
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["target-service", "--model", "m"])
    assert exit_.value.code == 2
    assert "TANDEM_GRACE_S" in capsys.readouterr().err


def test_variables_fill_the_defaults_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_GRACE_S", "12.5")
    parser = build_parser()
    assert parser.parse_args(["target-service", "--model", "m"]).grace_s == 12.5
    assert parser.parse_args(["target-service", "--model", "m", "--grace-s", "3"]).grace_s == 3.0


def test_tandem_generate_reports_a_failed_call_in_one_line() -> None:
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "tandem.cli", "generate", "x", "--address",
                             "127.0.0.1:1"], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("generate: UNAVAILABLE: "), result.stderr
