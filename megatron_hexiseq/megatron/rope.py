"""RoPE from each rank's global token positions.

``GPTModel`` computes rotary frequencies for ``local_len x CP`` positions and keeps Megatron's
even 2 x CP zig-zag slice of them; under an uneven layout that slice is wrong. ``install_rope``
replaces ``model.rotary_pos_emb`` with ``LayoutRotaryEmbedding``, which returns the frequencies
of exactly this rank's global positions (segment order), computed with the original module's
``inv_freq`` / interpolation / interleaving and kept as a non-persistent buffer (it follows
``model.cuda()``/``.to()``; no ``torch.cuda.current_device()``; not in checkpoints).

The angles stay float32 whatever the module's dtype. Megatron's ``Float16Module`` calls
``module.bfloat16()``/``.half()``, which casts every floating buffer: bf16 angles at position 120000
are off by up to 256 (every 256 consecutive positions share one value) and fp16 angles overflow
past 65504. So the buffers are the int64 positions and the float32 ``inv_freq`` bits stored as
int32 (neither is cast), and after every ``_apply`` (``.to``, ``.cuda``, ``.bfloat16``) the float32
angles are recomputed from them on the module's device. Stock ``RotaryEmbedding`` computes its
angles in float32 in every forward for the same reason.

With per-micro-batch layouts (``batch_layout.MicroBatchLayout``) the rank's positions change every
micro-batch: the angles are computed once per micro-batch at the plan's RoPE positions (global, or
inside each document with ``--reset-position-ids``), from the plan's device index (the one
host-to-device copy the slicer shares), and ``get_rotary_seq_len`` is the plan's token count.

Shape: ``forward(...) -> emb [s_r, 1, 1, rotary_dim]`` (float32), as ``RotaryEmbedding.forward``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.megatron.batch_layout import MicroBatchLayout
from megatron_hexiseq.megatron.documents import MicroBatchDocuments, positions_in_documents

if TYPE_CHECKING:  # for annotations only: importing it at run time loads much of megatron.core
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding


def rope_angles(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    interleaved: bool = False,
    interpolation_factor: float | None = None,
) -> torch.Tensor:
    """Megatron ``RotaryEmbedding.get_emb`` evaluated at ``positions [s]`` -> ``[s, 1, 1, 2*len(inv_freq)]``."""
    seq = positions.to(dtype=inv_freq.dtype, device=inv_freq.device)
    if interpolation_factor is not None:
        seq = seq * (1 / interpolation_factor)
    freqs = torch.outer(seq, inv_freq)  # [s, dim/2]
    if not interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    return emb[:, None, None, :]


class LayoutRotaryEmbedding(nn.Module):
    """Drop-in for ``model.rotary_pos_emb``: this rank's frequencies, whatever length is asked."""

    positions: torch.Tensor  # [s_r] int64 buffer
    inv_freq_bits: torch.Tensor  # [rotary_dim / 2] int32 buffer (float32 bits)
    emb: torch.Tensor  # [s_r, 1, 1, rotary_dim] float32 buffer

    def __init__(
        self,
        original: RotaryEmbedding,
        positions: Sequence[int],
        documents: MicroBatchDocuments | None = None,
        batch_layout: MicroBatchLayout | None = None,
    ) -> None:
        super().__init__()
        self.documents = documents
        self.batch_layout = batch_layout
        self._plan_key: object = None
        self._plan_emb: torch.Tensor | None = None
        self._host_positions = tuple(int(p) for p in positions)
        self._doc_key: object = None
        self._doc_emb: torch.Tensor | None = None
        for name in ("inv_freq", "rotary_interleaved", "seq_len_interpolation_factor"):
            if not hasattr(original, name):
                raise HexiSeqError(
                    f"cannot replace {type(original).__name__}: it has no '{name}' "
                    "(only standard RoPE is supported with HexiSeq)"
                )
        self.num_tokens = len(positions)
        self.rotary_interleaved = original.rotary_interleaved
        self.interpolation_factor = original.seq_len_interpolation_factor
        inv_freq = original.inv_freq.detach().to("cpu", torch.float32).contiguous()
        self.register_buffer(
            "positions", torch.tensor(list(positions), dtype=torch.int64), persistent=False
        )
        self.register_buffer("inv_freq_bits", inv_freq.view(torch.int32).clone(), persistent=False)
        self.register_buffer("emb", self._angles(), persistent=False)

    def _angles(self) -> torch.Tensor:
        """float32 angles ``[s_r, 1, 1, rotary_dim]`` on the buffers' device."""
        inv_freq = self.inv_freq_bits.view(torch.float32)
        return rope_angles(
            self.positions,
            inv_freq,
            interleaved=self.rotary_interleaved,
            interpolation_factor=self.interpolation_factor,
        )

    def _apply(
        self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
    ) -> LayoutRotaryEmbedding:
        super()._apply(fn, recurse)
        self.emb = self._angles()  # float32 again, on the (possibly new) device
        self._doc_key, self._doc_emb = None, None
        self._plan_key, self._plan_emb = None, None
        return self

    def _plan_angles(self) -> torch.Tensor | None:
        """With per-micro-batch layouts: float32 angles at the current plan's RoPE positions, once
        per micro-batch (from the plan's device index; no host-to-device copy of its own)."""
        if self.batch_layout is None:
            return None
        plan = self.batch_layout.current()
        if self._plan_key is not plan:
            _, rope = plan.indices(self.positions.device)
            self._plan_emb = rope_angles(
                rope,
                self.inv_freq_bits.view(torch.float32),
                interleaved=self.rotary_interleaved,
                interpolation_factor=self.interpolation_factor,
            )
            self._plan_key = plan
        return self._plan_emb

    def _document_angles(self) -> torch.Tensor | None:
        """With ``--reset-position-ids``: float32 angles at each token's position inside its
        document (once per micro-batch; one small pinned, non-blocking host-to-device copy; the
        Megatron plugin's prepared-ahead path takes them from the plan instead). None when the micro-batch's
        samples have different boundaries (the angles are per token, shared by the samples: the
        global positions are used then, which is the same attention since RoPE is relative and no
        score crosses a document)."""
        docs = self.documents
        if docs is None or not docs.reset_position_ids or docs.bounds is None:
            return None
        if not docs.bounds.shared:
            return None
        if self._doc_key != docs.bounds:
            local = torch.tensor(
                positions_in_documents(self._host_positions, docs.bounds.samples[0]),
                dtype=torch.int64,
            )
            if self.positions.device.type == "cuda":
                local = local.pin_memory()
            self._doc_emb = rope_angles(
                local.to(self.positions.device, non_blocking=True),
                self.inv_freq_bits.view(torch.float32),
                interleaved=self.rotary_interleaved,
                interpolation_factor=self.interpolation_factor,
            )
            self._doc_key = docs.bounds
        return self._doc_emb

    def get_rotary_seq_len(self, *args: Any, **kwargs: Any) -> int:
        """GPTModel asks for a length before calling forward; ours is the layout's (the
        micro-batch's with per-micro-batch layouts)."""
        if self.batch_layout is not None:
            return self.batch_layout.current().num_tokens
        return self.num_tokens

    def forward(
        self,
        max_seq_len: int | None = None,
        offset: int = 0,
        packed_seq: bool = False,
        cp_group: dist.ProcessGroup | None = None,
    ) -> torch.Tensor:
        if packed_seq or offset:
            raise HexiSeqError(
                "HexiSeq RoPE supports neither packed sequences nor position offsets"
            )
        emb = self._plan_angles()
        if emb is None:
            emb = self._document_angles()
        return self.emb if emb is None else emb


def install_rope(
    model: nn.Module,
    positions: Sequence[int],
    documents: MicroBatchDocuments | None = None,
    batch_layout: MicroBatchLayout | None = None,
) -> None:
    """Replace ``model.rotary_pos_emb`` (a megatron-core ``GPTModel`` using RoPE) in place;
    ``documents``: restart the angles in each document (``--reset-position-ids``);
    ``batch_layout``: the positions of each micro-batch's layout instead of ``positions``."""
    original = getattr(model, "rotary_pos_emb", None)
    if original is None:
        return  # learned absolute or no position embedding: sliced position_ids already suffice
    if isinstance(original, LayoutRotaryEmbedding):
        return
    model.rotary_pos_emb = LayoutRotaryEmbedding(original, positions, documents, batch_layout)
