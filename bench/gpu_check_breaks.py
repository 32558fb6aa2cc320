"""Attention broken on purpose, for ``gpu_check.py --self-test`` (test-only; never used in training).

``broken_attention(kind)`` is a context manager that replaces one function of the attention runtime
for the duration of the block, in every loaded module that holds it, and restores it on exit:

- ``zeros``: every block kernel call (``kernels.block_forward``) returns an all-zeros output (its
  LSE is kept): HexiSeq attention then outputs zeros;
- ``drop``: the first received block of every sub-ring forward is not merged
  (``subring._block_forward`` skips it): the queries of that block miss those keys;
- ``heads``: every block kernel call reads query head h - 1 in place of query head h (a wrong head
  map; a block with one query head is unchanged).

A check catches a break when it fails under it. The pytest part runs in a subprocess; this module is
also a pytest plugin (``-p gpu_check_breaks --hexiseq-break KIND``) that enters the same context
manager before the test modules are imported.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

BREAKS = ("zeros", "drop", "heads")


def _zeros_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    def block_forward(*args: Any, **kwargs: Any) -> Any:
        out, lse = original(*args, **kwargs)
        return out * 0, lse  # same dtype, shape and device; zero values

    return block_forward


def _heads_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    def block_forward(*args: Any, **kwargs: Any) -> Any:
        if args:  # the queries come first: [S, B, H, D]
            args = (args[0].roll(1, dims=2), *args[1:])
        else:
            name = next(n for n in kwargs if n.startswith("q"))
            kwargs[name] = kwargs[name].roll(1, dims=2)
        return original(*args, **kwargs)

    return block_forward


def _drop_first_received(original: Callable[..., Any]) -> Callable[..., Any]:
    def _block_forward(c: Any, step: Any, *args: Any, **kwargs: Any) -> Any:
        first = next(s for s in c.sched.steps if s.computes)
        if step is first:
            return None  # the block's keys never reach (out, lse)
        return original(c, step, *args, **kwargs)

    return _block_forward


def _targets(kind: str) -> tuple[str, str, Callable[[Callable[..., Any]], Callable[..., Any]]]:
    """(module, attribute, wrapper factory) of a break."""
    if kind == "zeros":
        return "megatron_hexiseq.attention.kernels", "block_forward", _zeros_forward
    if kind == "heads":
        return "megatron_hexiseq.attention.kernels", "block_forward", _heads_forward
    if kind == "drop":
        return "megatron_hexiseq.attention.subring", "_block_forward", _drop_first_received
    raise ValueError(f"unknown break {kind!r}; choose one of {', '.join(BREAKS)}")


@contextlib.contextmanager
def broken_attention(kind: str | None) -> Iterator[None]:
    """Break attention as ``kind`` says (None: leave it intact) until the block exits."""
    if kind is None:
        yield
        return
    import importlib

    module_name, attr, factory = _targets(kind)
    original = getattr(importlib.import_module(module_name), attr)
    wrapped = factory(original)
    patched = []
    for mod in list(sys.modules.values()):  # every module that bound the function by name
        for name, value in list(getattr(mod, "__dict__", {}).items()):
            if value is original:
                setattr(mod, name, wrapped)
                patched.append((mod, name))
    try:
        yield
    finally:
        for mod, name in patched:
            setattr(mod, name, original)


# ---- pytest plugin ------------------------------------------------------------------------------
_ACTIVE: list[contextlib.AbstractContextManager[None]] = []


def pytest_addoption(parser: Any) -> None:
    parser.addoption("--hexiseq-break", choices=BREAKS, default=None, help="break attention")


def pytest_configure(config: Any) -> None:
    kind = config.getoption("--hexiseq-break")
    if kind is not None:
        cm = broken_attention(kind)
        cm.__enter__()
        _ACTIVE.append(cm)


def pytest_unconfigure(config: Any) -> None:
    while _ACTIVE:
        _ACTIVE.pop().__exit__(None, None, None)
