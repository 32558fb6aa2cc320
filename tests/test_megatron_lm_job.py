"""``--hexiseq-job`` against the real Megatron-LM ``core_v0.16.1``: layer (b), 3 gloo ranks.

Needs ``MEGATRON_LM`` (a Megatron-LM checkout at tag ``core_v0.16.1``; skipped when unset), as
tests/test_megatron_lm.py. Megatron-LM's own ``parse_args`` + ``validate_args`` accept the job's
flags (``--context-parallel-size`` = world size, the job's global and micro-batch sizes, a
sequence length that is no multiple of 2 x CP), and refuse, in one line on every rank, a global
batch that is not the job's and a data-loader type the job cannot split. Then Megatron-LM's own
``model_provider`` / ``gpt_builders`` through ``plugin.model_provider`` on the job of
tests/test_job_runtime.py (1 + 2 ranks, 3 and 1 micro-batches; the pair listed high rank first):

- every layer has ``HexiSeqCoreAttention`` and ``pretrain_gpt.get_batch_on_this_cp_rank`` keeps
  each rank's positions of its domain's (renumbered) layout;
- the weights are the first rank's on every rank (64-bit hashes equal) although every rank drew
  them with its own seed here;
- ``megatron.training.training.get_forward_backward_func()`` is Megatron's no-pipelining schedule
  running the domain's micro-batch count, and ``build_pretraining_data_loader`` reads the domain's
  samples of each step (the real ``torch`` DataLoader over the job's sampler).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from test_job_runtime import job_1_2
from test_megatron_lm import _parse  # Megatron-LM's parse_args + validate_args with our flags

from megatron_hexiseq.testbed.spawn import run_ranks

MEGATRON_LM = os.environ.get("MEGATRON_LM")
pytestmark = pytest.mark.skipif(
    not MEGATRON_LM, reason="set MEGATRON_LM=<Megatron-LM core_v0.16.1 checkout>"
)

ARGV = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 8 --group-query-attention "
    "--num-query-groups 2 --ffn-hidden-size 96 --swiglu --normalization RMSNorm "
    "--position-embedding-type rope --seq-length 48 --max-position-embeddings 48 "
    "--micro-batch-size 1 --global-batch-size 4 --lr 1e-3 --train-iters 1 --transformer-impl local "
    "--context-parallel-size 3 --cp-comm-type hexiseq --calculate-per-token-loss "
    "--hexiseq-kernel reference --use-cpu-initialization --no-gradient-accumulation-fusion "
    "--attention-dropout 0 --hidden-dropout 0 --disable-bias-linear "
    "--no-create-attention-mask-in-dataloader --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 128 --no-rope-fusion --no-masked-softmax-fusion --no-bias-dropout-fusion "
    "--no-persist-layer-norm"
).split()


def _worker(rank: int, world: int, checkout: str, job_path: str) -> dict:
    sys.path.insert(0, checkout)  # this fresh process imports Megatron-LM's megatron/
    import pretrain_gpt as stock
    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training import training
    from megatron.training.global_vars import set_args

    from megatron_hexiseq.errors import HexiSeqError
    from megatron_hexiseq.megatron import plugin
    from megatron_hexiseq.megatron.core_attention import HexiSeqCoreAttention
    from megatron_hexiseq.megatron.params_check import tensors_hash

    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    out: dict = {"errors": []}
    for change in (["--global-batch-size", "8"], ["--dataloader-type", "cyclic"]):
        args = _parse(ARGV + ["--hexiseq-job", job_path] + change, rank, world)
        try:
            plugin.setup(args, None)
        except HexiSeqError as e:
            out["errors"].append(str(e))
    args = _parse(ARGV + ["--hexiseq-job", job_path], rank, world)
    out["seq_length"] = args.seq_length
    set_args(args)
    mpu.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=3)
    provider = plugin.model_provider(stock.model_provider, stock.gpt_builder, stock)
    torch.manual_seed(100 + rank)  # every rank draws other weights: the broadcast must fix them
    model = provider(
        pre_process=True,
        post_process=True,
        config=None,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    out["hexiseq_layers"] = sum(isinstance(m, HexiSeqCoreAttention) for m in model.modules())
    out["hash"] = tensors_hash(model.parameters())
    # Megatron's own get_batch: the plugin's prepared batch (this rank's slice), passed through
    out["tokens"] = stock.get_batch(iter([{"tokens": torch.arange(48).view(1, 48)}]))[0][0].tolist()
    schedule = training.get_forward_backward_func()
    out["schedule"] = (
        schedule.schedule is forward_backward_no_pipelining,
        schedule.micro_batches,
        schedule.total_micro_batches,
    )
    dataset = [torch.tensor([i]) for i in range(12)]
    loader = training.build_pretraining_data_loader(dataset, 4)  # resumed after one step
    out["samples"] = [b.view(-1).tolist() for b in loader]
    mpu.destroy_model_parallel()
    return out


def test_job_through_real_megatron_lm(tmp_path):
    assert (Path(MEGATRON_LM) / "pretrain_gpt.py").is_file()
    job = job_1_2()
    path = tmp_path / "job.json"
    job.save(path)
    results = run_ranks(_worker, 3, MEGATRON_LM, str(path), timeout_s=600)
    # process 0: domain 0 (3 micro-batches, samples 0-2 of each step); processes 1, 2: domain 1
    # (cluster ranks 2, 1 listed in that order: renumbered, process 1 runs the second segment set)
    layouts = [job.domains[0].layout.ranks[0], *reversed(job.domains[1].layout.ranks)]
    samples = [[[4], [5], [6], [8], [9], [10]], [[7], [11]], [[7], [11]]]
    for rank, res in enumerate(results):
        assert "global batch of 4 sequences but --global-batch-size is 8" in res["errors"][0]
        assert "--dataloader-type cyclic" in res["errors"][1]
        assert res["seq_length"] == 48 and res["hexiseq_layers"] == 4
        assert res["tokens"] == layouts[rank].positions()
        assert res["schedule"] == (True, job.domains[0 if rank == 0 else 1].micro_batches, 4)
        assert res["samples"] == samples[rank]
    assert len({res["hash"] for res in results}) == 1
