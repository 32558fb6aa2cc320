"""Peak bytes of the tensors a piece of code creates, counted at the dispatcher (CPU and meta).

CPU torch has no allocator peak counter (``torch.cuda.max_memory_allocated`` is CUDA only), so
``LiveBytes`` counts every storage an op returns while some Python tensor still refers to it:
a storage is added when first seen and dropped when the last tensor object seen on it is freed.
Storages that existed before (the inputs, ``exclude``) are never counted. What it does not see:
buffers a kernel allocates and frees inside one op (e.g. FlashAttention's float32 dq accumulator),
and tensors only C++ holds (autograd's saved tensors of ops run inside the mode are seen when
created). On the ``meta`` device the sizes are those the real op would allocate.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes(exclude=inputs) as m: ...``; then ``m.peak`` (bytes) and ``m.now``."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._known = {t.untyped_storage()._cdata for t in exclude}
        self._live: dict[int, tuple[int, set[int]]] = {}
        self.now = 0
        self.peak = 0

    def _drop(self, key: int, ref: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[1].discard(ref)
        if not entry[1]:
            self.now -= entry[0]
            del self._live[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self._known:
                continue
            if key not in self._live:
                self._live[key] = (storage.nbytes(), set())
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
            self._live[key][1].add(id(t))
            weakref.finalize(t, self._drop, key, id(t))
        return out
