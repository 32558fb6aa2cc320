"""Attention broken on purpose, for the GPU check's ``--self-test`` (test-only; never used in training).

``broken_attention(kind)`` is a context manager that replaces functions of the attention runtime
for the duration of the block, in every loaded module that holds them, and restores them on exit.
Each break reaches both ways a block is computed: the dense block calls (``kernels.block_forward``,
``subring._block_forward``) and the packed-document path (``attention/varlen.py``: its
variable-length calls ``_calls_forward`` and its window runners ``local_forward`` /
``merge_forward``; ``documents.document_schedule``):

- ``zeros``: every kernel call returns an all-zeros output (its LSE kept): attention outputs zeros;
- ``drop``: the first received block of every sub-ring forward is not merged (dense or windows):
  the queries of that block miss those keys;
- ``heads``: every kernel call reads query head h - 1 in place of query head h (a wrong head map; a
  call with one query head is unchanged);
- ``window``: every block's windows lose the window with the most (query, key) pairs (a dropped
  window: its queries miss those keys, or a local document gets no attention at all);
- ``boundary``: the runtime's schedule is built on wrong document boundaries: in every sample the
  boundary between the two adjacent documents with the most cross pairs is left out (the two
  documents attend to each other; the oracle keeps them apart). Micro-batches of one document are
  unchanged.

A check catches a break when it fails under it. The pytest part runs in a subprocess; this module is
also a pytest plugin (``-p gpu_check.breaks --hexiseq-break KIND``) that enters the same context
manager before the test modules are imported.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

BREAKS = ("zeros", "drop", "heads", "window", "boundary")
KERNELS = "megatron_hexiseq.attention.kernels"
SUBRING = "megatron_hexiseq.attention.subring"
VARLEN = "megatron_hexiseq.attention.varlen"
DOCUMENTS = "megatron_hexiseq.attention.documents"

Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]


def _zeros_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    def block_forward(*args: Any, **kwargs: Any) -> Any:
        out, lse = original(*args, **kwargs)
        return out * 0, lse  # same dtype, shape and device; zero values

    return block_forward


def _zeros_calls(original: Callable[..., Any]) -> Callable[..., Any]:
    def _calls_forward(wk, p, q_NHD, k_MGD, v_MGD, causal, out_NHD, lse_NH) -> None:
        original(wk, p, q_NHD, k_MGD, v_MGD, causal, out_NHD, lse_NH)
        out_NHD.zero_()  # the LSE stays

    return _calls_forward


def _heads_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    def block_forward(*args: Any, **kwargs: Any) -> Any:
        if args:  # the queries come first: [S, B, H, D]
            args = (args[0].roll(1, dims=2), *args[1:])
        else:
            name = next(n for n in kwargs if n.startswith("q"))
            kwargs[name] = kwargs[name].roll(1, dims=2)
        return original(*args, **kwargs)

    return block_forward


def _heads_calls(original: Callable[..., Any]) -> Callable[..., Any]:
    def _calls_forward(wk, p, q_NHD, *rest) -> None:
        original(wk, p, q_NHD.roll(1, dims=1), *rest)  # packed queries [N, H, D]

    return _calls_forward


def _drop_first_received(original: Callable[..., Any]) -> Callable[..., Any]:
    def _block_forward(c: Any, step: Any, *args: Any, **kwargs: Any) -> Any:
        first = next(s for s in c.sched.steps if s.computes)
        if step is first:
            return None  # the block's keys never reach (out, lse)
        return original(c, step, *args, **kwargs)

    return _block_forward


_FIRST = threading.local()  # per rank thread: the windows forward has not merged a block yet


def _arm_after_local(original: Callable[..., Any]) -> Callable[..., Any]:
    def local_forward(*args: Any, **kwargs: Any) -> Any:
        _FIRST.pending = True  # every sub-ring forward with windows starts with its local block
        return original(*args, **kwargs)

    return local_forward


def _drop_first_merge(original: Callable[..., Any]) -> Callable[..., Any]:
    def merge_forward(*args: Any, **kwargs: Any) -> Any:
        if getattr(_FIRST, "pending", False):
            _FIRST.pending = False
            return None
        return original(*args, **kwargs)

    return merge_forward


def _largest_window_dropped(original: Callable[..., Any]) -> Callable[..., Any]:
    def runner(wk: Any, windows: tuple, *args: Any, **kwargs: Any) -> Any:
        if windows:

            def pairs(w: Any) -> int:
                return (w.row_hi - w.row_lo) * (w.key_hi - w.key_lo)

            drop = max(range(len(windows)), key=lambda i: pairs(windows[i]))
            windows = windows[:drop] + windows[drop + 1 :]
        return original(wk, windows, *args, **kwargs)

    return runner


def _merged_documents(original: Callable[..., Any]) -> Callable[..., Any]:
    def document_schedule(layout: Any, rank: int, bounds: Any, *args: Any, **kwargs: Any) -> Any:
        samples = []
        for cut in bounds.samples:
            if len(cut) > 2:  # leave out the boundary between the two most-paired documents
                sizes = [b - a for a, b in zip(cut, cut[1:])]
                i = max(range(1, len(cut) - 1), key=lambda j: sizes[j - 1] * sizes[j])
                cut = cut[:i] + cut[i + 1 :]
            samples.append(cut)
        wrong = type(bounds)(bounds.seq_length, tuple(samples), bounds.shared)
        return original(layout, rank, wrong, *args, **kwargs)

    return document_schedule


def _targets(kind: str) -> list[tuple[str, str, Wrapper]]:
    """(module, attribute, wrapper factory) of each function a break replaces."""
    if kind == "zeros":
        return [
            (KERNELS, "block_forward", _zeros_forward),
            (VARLEN, "_calls_forward", _zeros_calls),
        ]
    if kind == "heads":
        return [
            (KERNELS, "block_forward", _heads_forward),
            (VARLEN, "_calls_forward", _heads_calls),
        ]
    if kind == "drop":
        return [
            (SUBRING, "_block_forward", _drop_first_received),
            (VARLEN, "local_forward", _arm_after_local),
            (VARLEN, "merge_forward", _drop_first_merge),
        ]
    if kind == "window":
        return [
            (VARLEN, "local_forward", _largest_window_dropped),
            (VARLEN, "merge_forward", _largest_window_dropped),
        ]
    if kind == "boundary":
        return [(DOCUMENTS, "document_schedule", _merged_documents)]
    raise ValueError(f"unknown break {kind!r}; choose one of {', '.join(BREAKS)}")


@contextlib.contextmanager
def broken_attention(kind: str | None) -> Iterator[None]:
    """Break attention as ``kind`` says (None: leave it intact) until the block exits."""
    if kind is None:
        yield
        return
    patched = []
    for module_name, attr, factory in _targets(kind):
        original = getattr(importlib.import_module(module_name), attr)
        wrapped = factory(original)
        for mod in list(sys.modules.values()):  # every module that bound the function by name
            for name, value in list(getattr(mod, "__dict__", {}).items()):
                if value is original:
                    setattr(mod, name, wrapped)
                    patched.append((mod, name, original))
    try:
        yield
    finally:
        for mod, name, original in reversed(patched):
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
