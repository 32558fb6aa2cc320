"""Swap ``HexiSeqCoreAttention`` into megatron-core layer/block specs.

``hexiseq_spec(spec, runtime)`` returns a copy of ``spec`` in which every ``core_attention``
submodule (of every layer, including ``TransformerBlockSubmodules.layer_specs`` of MoE block specs
and Transformer Engine specs) becomes ``ModuleSpec(HexiSeqCoreAttention, params={"runtime": ...})``.
Everything else (TE linear/norm layers on GPU, MLPs, MoE) is left in place. The input spec is not
modified (Megatron's spec helpers may share submodule objects).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, cast

from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.megatron.core_attention import HexiSeqCoreAttention
from megatron_hexiseq.megatron.runtime import HexiSeqRuntime

if TYPE_CHECKING:  # annotations only: the block module imports much of megatron.core
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules


def hexiseq_core_attention_spec(runtime: HexiSeqRuntime) -> ModuleSpec:
    """The core-attention spec bound to ``runtime``."""
    return ModuleSpec(module=HexiSeqCoreAttention, params={"runtime": runtime})


def hexiseq_spec(
    spec: ModuleSpec | TransformerBlockSubmodules, runtime: HexiSeqRuntime
) -> ModuleSpec | TransformerBlockSubmodules:
    """Copy of ``spec`` with every ``core_attention`` replaced; raises if there is none."""
    replacement = hexiseq_core_attention_spec(runtime)
    count = [0]
    out = cast("ModuleSpec | TransformerBlockSubmodules", _swap(spec, replacement, count))
    if count[0] == 0:
        raise HexiSeqError(
            f"no core_attention found in the layer spec ({type(spec).__name__}); "
            "HexiSeq needs a spec with self-attention"
        )
    return out


def count_core_attention(
    spec: ModuleSpec | TransformerBlockSubmodules, cls: type = HexiSeqCoreAttention
) -> int:
    """How many ``core_attention`` slots of ``spec`` build ``cls`` (a test/diagnostic helper)."""
    found = []

    def visit(x: object) -> None:
        if isinstance(x, (list, tuple)):
            for y in x:
                visit(y)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            for f in dataclasses.fields(x):
                v = getattr(x, f.name)
                if f.name == "core_attention":
                    found.append(v.module if isinstance(v, ModuleSpec) else v)
                else:
                    visit(v)

    visit(spec)
    return sum(1 for m in found if m is cls)


def _swap(x: object, replacement: ModuleSpec, count: list[int]) -> object:
    if isinstance(x, list):
        return [_swap(y, replacement, count) for y in x]
    if isinstance(x, tuple):
        return tuple(_swap(y, replacement, count) for y in x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        changes = {}
        for f in dataclasses.fields(x):
            if not f.init:
                continue
            v = getattr(x, f.name)
            if f.name == "core_attention":
                changes[f.name] = replacement
                count[0] += 1
            else:
                new = _swap(v, replacement, count)
                if new is not v:
                    changes[f.name] = new
        return dataclasses.replace(x, **changes) if changes else x
    return x
