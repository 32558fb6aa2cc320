"""Checkpoints of the CPU training driver that survive a new layout (megatron-core ``torch_dist``).

Megatron's optimizers do not run on CPU, so the driver trains with ``torch.optim.AdamW`` over the
Megatron DDP buffers; a checkpoint is one ``megatron.core.dist_checkpointing.save`` into
``<dir>/iter_<step:07d>/`` plus Megatron-LM's tracker file ``latest_checkpointed_iteration.txt``
(written atomically by rank 0 once every rank has saved):

- ``model``: the GPT's own ``sharded_state_dict()`` (parameters replicated over DP x CP: one replica
  writes each tensor);
- ``optimizer``: AdamW's ``exp_avg`` and ``exp_avg_sq`` of every parameter as a ShardedTensor keyed
  by the parameter's name (``optimizer.<name>.<state>``), replica id = the rank in DP x CP, so
  rank 0 of DP x CP writes each;
- the common state (rank 0 writes it; it is the same on every rank): the run record
  (``checkpoint.RECORD_KEY``: model, sequence length, world), the number of steps done, AdamW's
  ``step`` counts and hyper-parameters, torch's RNG state, and the data position (next step,
  data seed).

:func:`check_checkpoint` runs first, before the model is built: rank 0 checks the record and the
data position against this run (``checkpoint.check_resume``: another model, sequence length or data
is refused with one line on every rank). :func:`load_checkpoint` then builds the same sharded state
dict on the new world and loads it: nothing is converted, whatever the old and new layouts were.

``checkpoint_shim()`` is the CPU-only stand-in that lets ``dist_checkpointing`` run without CUDA
(``torch.cuda.current_device`` -> CPU, ``torch.cuda.synchronize`` a no-op); testbed code only.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.io import write_text_atomic
from megatron_hexiseq.megatron.checkpoint import (
    RECORD_KEY,
    TRACKER,
    RunRecord,
    check_resume,
    find_checkpoint,
    on_rank0_for_all,
    read_record,
)
from megatron_hexiseq.megatron.config import cpu_device_shim
from megatron_hexiseq.testbed.train_config import TrainConfig

if TYPE_CHECKING:  # annotations only: importing it at run time loads much of megatron.core
    from megatron.core.models.gpt import GPTModel

ADAM_STATES = ("exp_avg", "exp_avg_sq")


def run_record(cfg: TrainConfig) -> RunRecord:
    """The facts a CPU-driver checkpoint depends on (Megatron's argument names)."""
    m = cfg.model
    model = {
        "num_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "ffn_hidden_size": m.ffn_hidden_size,
        "num_attention_heads": m.num_attention_heads,
        "num_query_groups": m.num_query_groups,
        "kv_channels": m.kv_channels,
        "padded_vocab_size": m.vocab_size,
        "swiglu": m.swiglu,
        "normalization": m.normalization,
        "add_bias_linear": m.add_bias_linear,
        "untie_embeddings_and_output_weights": True,
        "num_experts": None,
        "position_embedding_type": "rope",
    }
    W = cfg.layout.world_size
    return RunRecord.from_dict(
        {
            "model": model,
            "seq_length": cfg.layout.seq_length,
            "world_size": W * cfg.data_parallel,
            "context_parallel_size": W,
            "data_parallel_size": cfg.data_parallel,
        }
    )


@contextlib.contextmanager
def checkpoint_shim() -> Iterator[None]:
    """``dist_checkpointing`` on a CPU-only torch: CUDA device calls become CPU / no-ops (CPU driver only)."""
    with cpu_device_shim(), warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", category=FutureWarning
        )  # torch.distributed.checkpoint deprecations
        warnings.filterwarnings(
            "ignore", category=UserWarning, module=r"torch\.distributed\.checkpoint"
        )
        if torch.cuda.is_available():
            yield
            return
        original = torch.cuda.synchronize
        torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
        try:
            yield
        finally:
            torch.cuda.synchronize = original  # type: ignore[assignment]


def _sharded(
    model: GPTModel, opt: torch.optim.Optimizer, replica: int, *, template: bool
) -> dict[str, Any]:
    """``{"model": ..., "optimizer": {name: {state: ShardedTensor}}}`` (``template``: empty tensors to load into)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    optimizer = {}
    for name, p in model.named_parameters():
        state = opt.state.get(p, {})
        optimizer[name] = {
            key: ShardedTensor.from_rank_offsets(
                f"optimizer.{name}.{key}",
                torch.empty_like(p) if template else state[key].detach(),
                replica_id=replica,
            )
            for key in ADAM_STATES
        }
    return {"model": model.sharded_state_dict(), "optimizer": optimizer}


def save_checkpoint(
    cfg: TrainConfig,
    model: GPTModel,
    opt: torch.optim.Optimizer,
    steps_done: int,
    *,
    dp_cp_group: Any,
    record: RunRecord | None = None,
    consumed_samples: int | None = None,
) -> str:
    """Collective: save after ``steps_done`` steps into ``cfg.save_dir/iter_<steps_done:07d>``; returns it.

    ``record``: the run's record (default ``run_record(cfg)``; a job's driver gives its own);
    ``consumed_samples``: the data position in samples, stored beside the next step when given."""
    from megatron.core import dist_checkpointing

    save_dir = cfg.save_dir
    if save_dir is None:
        raise ValueError("save_checkpoint needs cfg.save_dir")
    folder = os.path.join(save_dir, f"iter_{steps_done:07d}")
    if dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
    dist.barrier()
    names: dict[torch.Tensor, str] = {p: n for n, p in model.named_parameters()}
    state = _sharded(model, opt, dist.get_rank(dp_cp_group), template=False)
    state.update(
        {
            RECORD_KEY: (record or run_record(cfg)).to_dict(),
            "iteration": steps_done,
            "optimizer_steps": {names[p]: float(s["step"]) for p, s in opt.state.items()},
            "optimizer_groups": [
                {k: v for k, v in g.items() if k != "params"} for g in opt.param_groups
            ],
            "rng_state": torch.get_rng_state(),
            "data": {"next_step": steps_done, "data_seed": cfg.data_seed}
            | ({} if consumed_samples is None else {"consumed_samples": consumed_samples}),
        }
    )
    with checkpoint_shim():
        dist_checkpointing.save(state, folder)
    dist.barrier()
    if dist.get_rank() == 0:
        write_text_atomic(os.path.join(save_dir, TRACKER), f"{steps_done}\n")
    dist.barrier()
    return folder


def check_checkpoint(cfg: TrainConfig, *, record: RunRecord | None = None) -> str:
    """Collective, before anything is built: the folder ``cfg.load_dir`` resumes from, once rank 0
    has checked its record (``record``, default ``run_record(cfg)``) and data position against
    ``cfg`` (the same one-line error on every rank)."""
    load_dir = cfg.load_dir
    if load_dir is None:
        raise ValueError("check_checkpoint needs cfg.load_dir")
    found: list[str | None] = [None]

    def check() -> None:
        folder = find_checkpoint(load_dir)
        if folder is None:
            raise HexiSeqError(
                f"no checkpoint in {load_dir} (no {TRACKER}); train without load_dir to start afresh"
            )
        where = f"checkpoint {folder}"
        check_resume(read_record(folder), record or run_record(cfg), where=where)
        from megatron.core import dist_checkpointing

        common = dist_checkpointing.load_common_state_dict(folder)
        if common["data"]["data_seed"] != cfg.data_seed:
            raise HexiSeqError(
                f"{where} was trained on data_seed {common['data']['data_seed']}, this run has "
                f"{cfg.data_seed}: resume on the same data"
            )
        if common["iteration"] >= cfg.steps:
            raise HexiSeqError(
                f"{where} has done {common['iteration']} steps and this run asks for steps={cfg.steps}: "
                "nothing is left to train; raise steps"
            )
        found[0] = folder

    on_rank0_for_all(check)
    dist.broadcast_object_list(found, src=0)
    assert found[0] is not None
    return found[0]


def load_checkpoint(
    folder: str, model: GPTModel, opt: torch.optim.Optimizer, *, dp_cp_group: Any
) -> int:
    """Collective: load ``folder`` (from :func:`check_checkpoint`) into ``model`` and ``opt``; returns the
    number of steps it had done (the first step to run)."""
    from megatron.core import dist_checkpointing

    with checkpoint_shim():
        common = dist_checkpointing.load_common_state_dict(folder)
        loaded = dist_checkpointing.load(
            _sharded(model, opt, dist.get_rank(dp_cp_group), template=True), folder
        )
    model.load_state_dict(loaded["model"], strict=True)
    for name, p in model.named_parameters():
        opt.state[p] = {
            "step": torch.tensor(common["optimizer_steps"][name], dtype=torch.float32),
            **{key: loaded["optimizer"][name][key] for key in ADAM_STATES},
        }
    for group, saved in zip(opt.param_groups, common["optimizer_groups"]):
        group.update(saved)
    torch.set_rng_state(common["rng_state"])
    return int(common["iteration"])


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict]:
    """Copies of the parameters and of AdamW's state by parameter name (for tests):
    ``{"params": {name: tensor}, "opt_state": {name: {"step", "exp_avg", "exp_avg_sq"}}}``."""
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "opt_state": {
            n: {k: v.detach().clone() for k, v in opt.state[p].items()}
            for n, p in model.named_parameters()
            if p in opt.state
        },
    }
