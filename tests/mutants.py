"""Mutants for the statistical tests: a production function with one line of its maths broken.

A statistical test that passes proves little unless it fails for a wrong rule. Rather than
keep a second, hand-written copy of the sampling maths to break, a mutant recompiles the
real function's source with a single edit, in its own module's namespace. When that source
changes so the edit no longer applies, the mutant refuses to build: update the edit, and the
test keeps checking the function Tandem runs.
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def mutant(function: F, original: str, replacement: str) -> F:
    """`function` with the one occurrence of `original` in its source replaced."""
    source = textwrap.dedent(inspect.getsource(function))
    if source.count(original) != 1:
        raise AssertionError(f"the mutant edit {original!r} no longer applies to "
                             f"{function.__qualname__}: update it to the function's new source")
    namespace = dict(vars(inspect.getmodule(function)))
    code = compile(source.replace(original, replacement), f"<mutant of {function.__qualname__}>", "exec")
    exec(code, namespace)  # noqa: S102 -- the function's own source, one edit applied
    return namespace[function.__name__]  # type: ignore[no-any-return]
