"""Typed service configuration from CLI flags, with TANDEM_* environment variables as defaults.

Each service declares one frozen dataclass; every field becomes a flag `--field-name`
whose default comes from `TANDEM_FIELD_NAME` if set (12-factor, for Kubernetes), else
from the dataclass. Help text lives in each field's metadata.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, TypeVar

T = TypeVar("T")

# The most tokens one step drafts or scores as a block, on every service: a bound on what
# one request can make a replica compute in one pass.
MAX_BLOCK_TOKENS = 64
# The most (token, probability) pairs a draft sends per drafted token.
MAX_SUPPORT_SIZE = 1024
# The most stop token ids a target's decode run carries (a model's end-of-sequence ids).
MAX_STOP_TOKENS = 64
# The most top tokens a step returns log-probabilities for, per position (OpenAI allows 20).
MAX_TOP_LOGPROBS = 20


def option(default: Any, help: str) -> Any:
    return dataclasses.field(default=default, metadata={"help": help})


def _convert(kind: type, raw: str) -> Any:
    if kind is bool:
        return raw.strip().lower() in ("1", "true", "yes", "on")
    return kind(raw)


def _parser_of(kind: type, flag: str, env: str) -> Any:
    """argparse's `type`: it also converts a default given as a string (a variable's value),
    and only for the command being run, so one bad variable fails that command alone."""
    def parse(raw: str) -> Any:
        try:
            return _convert(kind, raw)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{raw!r} is not a valid {kind.__name__} (from {flag} or env {env})") from None
    parse.__name__ = kind.__name__
    return parse


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    for f in dataclasses.fields(cls):
        kind = type(f.default)
        env = f"TANDEM_{f.name.upper()}"
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{f.metadata.get('help', '')} [env {env}; default {f.default!r}]"
        if kind is bool:
            default = _convert(bool, os.environ[env]) if env in os.environ else f.default
            parser.add_argument(flag, dest=f.name, default=default,
                                action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, type=_parser_of(kind, flag, env),
                                default=os.environ.get(env, f.default), help=help_text)


def from_args(cls: type[T], args: argparse.Namespace) -> T:
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})  # type: ignore[arg-type]
