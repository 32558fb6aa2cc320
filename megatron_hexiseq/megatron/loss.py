"""Per-token loss: ranks of an uneven layout hold different token counts, so the loss is a sum.

Each rank returns ``(sum of masked token losses, number of loss tokens)`` (exactly what
``pretrain_gpt.loss_func`` returns under ``--calculate-per-token-loss``); Megatron (or
``testbed.train``) sums both over data-parallel x context-parallel ranks and divides once, so every
token of the global batch weighs the same. A per-rank mean would weigh a rank's tokens by
``1 / its token count``: wrong as soon as counts differ.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def per_token_loss(
    output_tensor: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``output_tensor`` per-token losses ``[b, s_r]`` -> ``(loss_sum [], num_tokens [] int)``."""
    losses = output_tensor.reshape(-1).float()
    mask = loss_mask.reshape(-1).float()
    return torch.sum(losses * mask), mask.sum().detach().to(torch.int)


def global_mean_loss(
    loss_sum: torch.Tensor, num_tokens: torch.Tensor, *, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Reporting: the per-token mean over ``group`` (Megatron's dp_cp group). Not differentiable."""
    both = torch.stack([loss_sum.detach().float(), num_tokens.float()])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(both, group=group)
    return both[0] / both[1].clamp(min=1)
