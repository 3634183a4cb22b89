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


def option(default: Any, help: str) -> Any:
    return dataclasses.field(default=default, metadata={"help": help})


def _convert(kind: type, raw: str) -> Any:
    if kind is bool:
        return raw.strip().lower() in ("1", "true", "yes", "on")
    return kind(raw)


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    for f in dataclasses.fields(cls):
        kind = type(f.default)
        env = f"TANDEM_{f.name.upper()}"
        default = _convert(kind, os.environ[env]) if env in os.environ else f.default
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{f.metadata.get('help', '')} [env {env}; default {default!r}]"
        if kind is bool:
            parser.add_argument(flag, dest=f.name, default=default,
                                action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, type=kind, default=default, help=help_text)


def from_args(cls: type[T], args: argparse.Namespace) -> T:
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})  # type: ignore[arg-type]
