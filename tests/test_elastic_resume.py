"""Lose a GPU, keep training: checkpoint, re-plan, resume on another world size. Layer (b), gloo.

The CPU driver (``testbed/train.py`` + ``testbed/ckpt.py``: tiny Megatron GPT, Megatron DDP,
AdamW, ``dist_checkpointing`` torch_dist) on layouts planned by the real planner for a small CPU
cluster spec (2 nodes x 2 devices of two speeds): the 4-rank layout, and ``plan --exclude cpu1:0``
for the 3 GPUs left.

- 4 -> 3: train 3 steps on 4 ranks and checkpoint; resume on 3 ranks for steps 4-6.
- 3 -> 4 (the GPU comes back): 3 steps on 3 ranks, resume on 4.
Each resumed run must (1) restore the saved parameters and AdamW state exactly (``torch.equal``:
the checkpoint is a lossless copy whatever the layouts), and (2) give steps 4-6 the losses,
parameters and optimizer state of an uninterrupted 4-rank run on the same data, to fp32
summation-order tolerances (derived below). A checkpoint of another model, sequence length or data
is refused with one line before training, on every rank. Megatron-style checkpoints (arguments in
the common state) are checked by ``checkpoint.check_before_training`` as the plugin does.
Layer (a) is tests/test_elastic.py; no layer (c) (docs/elastic.md).

Three spawns (3, 4, 3 ranks): each direction needs a save before a load at the other size.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace

import pytest
import torch
from test_megatron_gpt import reordering_tolerance  # the fp32 two-orderings bound, derived there

from megatron_hexiseq.cli import main
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout, make_layout
from megatron_hexiseq.megatron.checkpoint import TRACKER, check_before_training
from megatron_hexiseq.testbed.spawn import run_ranks
from megatron_hexiseq.testbed.train import TINY_GPT, TrainConfig, train_rank

CLUSTER = """name: cpu-testbed-2x2
gpus:
  FAST-CPU: {bf16_tflops: 0.2, memory_gib: 8, nvlink_GBps: 5, efficiency: 1.0}
  SLOW-CPU: {bf16_tflops: 0.1, memory_gib: 8, nvlink_GBps: 5, efficiency: 1.0}
nodes:
  - {name: cpu0, gpu: FAST-CPU, count: 2, network_GBps: 1}
  - {name: cpu1, gpu: SLOW-CPU, count: 2, network_GBps: 1}
"""
TINY = TINY_GPT  # 4 layers, hidden 64, GQA 8/2, SwiGLU, RMSNorm, vocab 128
MODEL = f"""name: tiny-gpt
num_layers: {TINY.num_layers}
hidden_size: {TINY.hidden_size}
num_attention_heads: {TINY.num_attention_heads}
num_query_groups: {TINY.num_query_groups}
ffn_hidden_size: {TINY.ffn_hidden_size}
vocab_size: {TINY.vocab_size}
swiglu: true
normalization: RMSNorm
add_bias_linear: false
seq_length: 48
"""
STEPS, SAVE_AT = 6, 3


def _jobs(rank: int, world_size: int, jobs: list) -> list:
    """Run ``("train", cfg)`` / ``("refused", cfg)`` (the HexiSeqError text, None if it trained) /
    ``("megatron", folder, args)`` (a torch_dist checkpoint holding Megatron-style ``args``) in order."""
    out = []
    for kind, *payload in jobs:
        if kind == "train":
            out.append(train_rank(rank, world_size, payload[0]))
        elif kind == "refused":
            try:
                train_rank(rank, world_size, payload[0])
                out.append(None)
            except HexiSeqError as e:
                out.append(str(e))
        else:
            out.append(_save_megatron_style(*payload))
    return out


def _save_megatron_style(folder: str, args: argparse.Namespace) -> str:
    """What Megatron-LM's save_checkpoint leaves for the start-up check: common state with ``args``."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from megatron_hexiseq.testbed.ckpt import checkpoint_shim

    step = os.path.join(folder, "iter_0000005")
    if dist.get_rank() == 0:
        os.makedirs(step)
    dist.barrier()
    with checkpoint_shim():
        dist_checkpointing.save(
            {
                "args": args,
                "iteration": 5,
                "w": ShardedTensor.from_rank_offsets(
                    "w", torch.ones(4), replica_id=dist.get_rank()
                ),
            },
            step,
        )
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(folder, TRACKER), "w") as f:
            f.write("5\n")
    return step


def _megatron_args(**kw) -> argparse.Namespace:
    base = dict(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=96,
        num_attention_heads=8,
        group_query_attention=True,
        num_query_groups=2,
        kv_channels=8,
        padded_vocab_size=128,
        seq_length=48,
        world_size=3,
        context_parallel_size=3,
        data_parallel_size=1,
        ckpt_format="torch_dist",
        use_distributed_optimizer=True,
        overlap_grad_reduce=True,
        ddp_bucket_size=None,
        save=None,
        load=None,
    )
    return argparse.Namespace(**{**base, **kw})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("elastic")
    (d / "cluster.yaml").write_text(CLUSTER)
    (d / "model.yaml").write_text(MODEL)
    plan = [
        "plan",
        "--cluster",
        str(d / "cluster.yaml"),
        "--model-config",
        str(d / "model.yaml"),
        "--time-limit",
        "2",
        "--reproducible",
        "--format",
        "json",
    ]
    assert main([*plan, "-o", str(d / "l4.json")]) == 0
    assert main([*plan, "--exclude", "cpu1:0", "-o", str(d / "l3.json")]) == 0
    l4, l3 = Layout.load(d / "l4.json"), Layout.load(d / "l3.json")
    assert (l4.world_size, l3.world_size) == (4, 3) and not l4.is_symmetric()
    d43, d34, meg = (str(d / n) for n in ("ckpt-4to3", "ckpt-3to4", "megatron"))
    for folder in (d43, d34, meg):
        os.makedirs(folder)
    cfg = dict(steps=STEPS, return_params=True)
    seq64 = make_layout(
        seq_length=64,
        num_attention_heads=8,
        num_query_groups=2,
        group_sizes=[1, 1, 1],
        segments=[[(0, 20)], [(20, 40)], [(40, 64)]],
        heads=[list(range(8))] * 3,
    )
    s3, meg_step = run_ranks(
        _jobs,
        3,
        [
            (
                "train",
                TrainConfig(
                    layout=l3, **{**cfg, "steps": SAVE_AT}, save_dir=d34, save_at_step=SAVE_AT
                ),
            ),
            ("megatron", meg, _megatron_args()),
        ],
        timeout_s=600,
    )[0]
    a4, s4, r4 = run_ranks(
        _jobs,
        4,
        [
            ("train", TrainConfig(layout=l4, **cfg)),
            (
                "train",
                TrainConfig(
                    layout=l4, **{**cfg, "steps": SAVE_AT}, save_dir=d43, save_at_step=SAVE_AT
                ),
            ),
            ("train", TrainConfig(layout=l4, **cfg, load_dir=d34)),
        ],
        timeout_s=600,
    )[0]
    per_rank = run_ranks(
        _jobs,
        3,
        [
            ("train", TrainConfig(layout=l3, **cfg, load_dir=d43)),
            (
                "refused",
                TrainConfig(layout=l3, **cfg, load_dir=d43, model=replace(TINY_GPT, num_layers=2)),
            ),
            ("refused", TrainConfig(layout=seq64, **cfg, load_dir=d43)),
            ("refused", TrainConfig(layout=l3, **cfg, load_dir=d43, data_seed=7)),
        ],
        timeout_s=600,
    )
    return {
        "uninterrupted": a4,
        "4->3": (s4, per_rank[0][0]),
        "3->4": (s3, r4),
        "refusals": [results[1:] for results in per_rank],
        "megatron": (meg, meg_step),
        "cfg": TrainConfig(layout=l4, **cfg),
    }


@pytest.mark.parametrize("direction", ["4->3", "3->4"])
def test_resume_on_another_world_matches_the_uninterrupted_run(runs, direction):
    saved, resumed = runs[direction]
    full = runs["uninterrupted"]
    assert (
        len(saved.losses) == SAVE_AT
        and resumed.start_step == SAVE_AT
        and len(resumed.losses) == STEPS - SAVE_AT
    )
    # (1) the checkpoint restores exactly what was saved, on the other world size
    assert resumed.resumed["params"].keys() == saved.params.keys() and len(saved.params) >= 4 * 4
    for name, want in saved.params.items():
        assert torch.equal(resumed.resumed["params"][name], want), name
    for name, state in saved.opt_state.items():
        assert (
            state.keys()
            == resumed.resumed["opt_state"][name].keys()
            == {"step", "exp_avg", "exp_avg_sq"}
        )
        for key, want in state.items():
            assert torch.equal(resumed.resumed["opt_state"][name][key], want), (name, key)
    # (2) steps 4-6 continue the uninterrupted 4-rank run. The two runs add the same terms in different
    # orders (other layouts and, for 3->4, steps 1-3 on other ranks), so they agree to the fp32 bound of
    # two summation orders over the N = 48 tokens and L + 1 = 5 reductions (tests/test_megatron_gpt.py):
    # 2.9e-5 relative. Losses are sums of positive terms: relative to themselves.
    tol = reordering_tolerance(runs["cfg"])
    torch.testing.assert_close(
        torch.tensor(resumed.losses), torch.tensor(full.losses[SAVE_AT:]), rtol=tol, atol=0
    )
    # Parameters: as in tests/test_megatron_gpt.py, AdamW's m / (sqrt(v) + eps) amplifies summation-order noise
    # of near-zero gradients, so each parameter's difference is compared with its update over steps 4-6
    # (norm-wise 1e-3 of it; measured 1.7e-5) and elementwise with 5% of one step (lr).
    at_save = runs["4->3"][0].params  # the 4-rank run after step 3
    for name, want in full.params.items():
        update = float(torch.linalg.vector_norm(want - at_save[name]))
        assert update > 0, name
        assert float(torch.linalg.vector_norm(resumed.params[name] - want)) <= 1e-3 * update, name
        torch.testing.assert_close(resumed.params[name], want, rtol=0, atol=0.05 * runs["cfg"].lr)
    # AdamW's state: the step count exactly; exp_avg is a positively weighted sum of the six gradients,
    # which change little in six steps at lr 1e-3 (they do not cancel), so its error is that of one
    # gradient (tol, norm-wise and elementwise relative to its largest magnitude); exp_avg_sq sums squared
    # gradients, whose relative error is twice: 2 tol (measured: 7e-7 and 5e-7 norm-wise).
    for name, want in full.opt_state.items():
        got = resumed.opt_state[name]
        assert float(got["step"]) == float(want["step"]) == STEPS
        for key, t in (("exp_avg", tol), ("exp_avg_sq", 2 * tol)):
            assert float(torch.linalg.vector_norm(got[key] - want[key])) <= t * float(
                torch.linalg.vector_norm(want[key])
            )
            torch.testing.assert_close(
                got[key],
                want[key],
                rtol=0,
                atol=t * float(want[key].abs().max()),
                msg=lambda m: f"{key} of {name}: {m}",
            )


def test_incompatible_checkpoints_are_refused_on_every_rank_before_training(runs):
    by_rank = runs["refusals"]
    assert all(
        msgs == by_rank[0] for msgs in by_rank
    )  # every rank raises the same line (rank 0 read it)
    model, seq, data = by_rank[0]
    assert "holds a model with num_layers 4 but this run builds 2" in model
    assert "was trained with --seq-length 48 but this run's layout is for 64" in seq
    assert "was trained on data_seed 99, this run has 7: resume on the same data" in data
    assert all("\n" not in m for m in by_rank[0])


def test_megatron_checkpoint_checked_at_start_up(runs):
    """``check_before_training`` as ``plugin.setup`` calls it, on a torch_dist checkpoint whose common
    state holds Megatron-style arguments (3 ranks, CP 3, distributed optimizer, default buckets)."""
    folder, step = runs["megatron"]
    assert step == os.path.join(folder, "iter_0000005")
    check_before_training(
        _megatron_args(load=folder, world_size=2, context_parallel_size=2)
    )  # 3 -> 2 GPUs: ok
    check_before_training(
        _megatron_args(load=folder + "-empty")
    )  # nothing saved yet: a fresh start
    for kw, match in (
        (dict(seq_length=96), "trained with --seq-length 48"),
        (dict(num_layers=4), "num_layers 2 but this run builds 4"),
        (
            dict(use_megatron_fsdp=True, ckpt_format="fsdp_dtensor"),
            "re-plan with --memory-mode distributed_optimizer",
        ),
        (dict(ddp_bucket_size=1000), "pass --ddp-bucket-size 40000000"),
        (dict(ckpt_format="torch"), "legacy format"),
    ):
        with pytest.raises(HexiSeqError, match=match):
            check_before_training(_megatron_args(load=folder, **kw))
