"""Elastic re-planning and the resume checks, layer (a): no processes.

- ``--exclude`` parsing and the cluster without the lost devices (node order, counts, device
  numbering, the GPU indices each host keeps), ``plan --exclude`` and its one-line errors;
- ``show`` / ``validate --previous``: ranks gone and added by ``host:gpu-index``, world size,
  predicted time and tokens/s, and the refusals (another sequence length or memory mode);
- ``megatron/checkpoint.py``: the run record of Megatron's arguments, every refusal of
  ``check_resume`` / ``check_options`` (model, sequence length, checkpoint format, optimizer, gradient
  buckets, TP x PP, RNG) and what is allowed (world size, DP, CP, recompute), the tracker file,
  reading a torch DCP checkpoint's arguments, ``plugin.setup`` refusing before it builds anything,
  and (with ``MEGATRON_LM``) the record read from Megatron-LM's real parsed arguments.
Layer (b) is tests/test_elastic_resume.py (gloo); there is no GPU-only layer (c): Megatron's
distributed optimizer and Megatron-FSDP need CUDA, see docs/elastic.md for what a GPU run checks.
"""

from __future__ import annotations

import argparse
import json

import pytest
from test_cli_planner import _error  # exit 2, one 'error: ' line, no traceback

from megatron_hexiseq.cli import main
from megatron_hexiseq.cluster import cluster_from_dict, cluster_to_dict
from megatron_hexiseq.elastic import (
    Exclusion,
    device_names,
    diff_layouts,
    exclude,
    parse_exclusions,
)
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout, make_layout
from megatron_hexiseq.megatron import checkpoint as ck

CLUSTER = """name: small
nodes:
  - {name: h0, gpu: H100-SXM-80GB, count: 4, network_GBps: 25}
  - {name: a0, gpu: A100-SXM-80GB, count: 2, network_GBps: 25}
  - {name: a1, gpu: A100-SXM-80GB, count: 2, network_GBps: 25}
"""


@pytest.fixture()
def files(tmp_path):
    (tmp_path / "c.yaml").write_text(CLUSTER)
    return tmp_path


def _plan(d, out, *extra, seq="16384"):
    return main(
        [
            "plan",
            "--cluster",
            str(d / "c.yaml"),
            "--model",
            "gpt-3b",
            "--seq-length",
            seq,
            "--time-limit",
            "2",
            "--reproducible",
            "-o",
            str(d / out),
            *extra,
        ]
    )


# ---- exclusion ---------------------------------------------------------------------------------
def test_parse_exclusions():
    assert parse_exclusions("h0:3, a1 h0:0") == (
        Exclusion("h0", 3),
        Exclusion("a1"),
        Exclusion("h0", 0),
    )
    assert [str(e) for e in parse_exclusions("h0:3,a1")] == ["h0:3", "a1"]
    for bad in ("", " , ", "h0:", "h0:x", ":3", "h0:-1"):
        with pytest.raises(HexiSeqError):
            parse_exclusions(bad)


def test_exclude_keeps_node_order_and_renumbers_devices(files):
    from megatron_hexiseq.cluster import load_cluster

    cluster = load_cluster(files / "c.yaml")
    kept = exclude(cluster, parse_exclusions("h0:1,a0,h0:3"))
    assert [(n.name, n.count) for n in kept.cluster.nodes] == [("h0", 2), ("a1", 2)]
    assert dict(kept.gpu_indices) == {"h0": (0, 2)}  # a1 lost nothing; a0 is gone entirely
    assert [(d.index, d.node, d.local_index) for d in kept.cluster.devices] == [
        (0, "h0", 0),
        (1, "h0", 1),
        (2, "a1", 0),
        (3, "a1", 1),
    ]
    # the same cluster as its own spec file would give (what plan writes into meta.cluster_spec)
    assert cluster_from_dict(cluster_to_dict(kept.cluster)) == kept.cluster
    assert (
        exclude(cluster, parse_exclusions("h0:1,h0")).gpu_indices == {}
    )  # a host and one of its GPUs
    with pytest.raises(HexiSeqError, match="has no host 'x9'"):
        exclude(cluster, parse_exclusions("x9"))
    assert [
        str(e) for e in exclude(cluster, parse_exclusions("x9,a0"), allow_absent=True).absent
    ] == ["x9"]
    with pytest.raises(HexiSeqError, match=r"host 'a0' has GPUs 0\.\.1"):
        exclude(cluster, parse_exclusions("a0:2"))
    with pytest.raises(HexiSeqError, match="leaves no GPU"):
        exclude(cluster, parse_exclusions("h0,a0,a1"))


def test_plan_exclude_and_show_previous(files, capsys):
    assert _plan(files, "old.json") == 0
    assert _plan(files, "new.json", "--exclude", "h0:1,a1") == 0
    out = capsys.readouterr().out
    assert "excluded: h0:1, a1; planned for the 5 GPUs left" in out
    old, new = Layout.load(files / "old.json"), Layout.load(files / "new.json")
    assert new.world_size == 5 and {r.host for r in new.ranks} <= {"h0", "a0"}
    assert new.meta["excluded"] == ["h0:1", "a1"] and new.meta["gpu_indices"] == {"h0": [0, 2, 3]}
    assert sorted(device_names(new)) == ["a0:0", "a0:1", "h0:0", "h0:2", "h0:3"]
    assert sorted(device_names(old)) == sorted(
        f"{h}:{i}" for h, n in (("h0", 4), ("a0", 2), ("a1", 2)) for i in range(n)
    )
    diff = diff_layouts(old, new)
    assert (
        diff.world_size == (8, 5) and diff.kept == 5 and not diff.added and not diff.resume_problems
    )
    assert sorted(diff.gone) == [
        "a1:0 (A100-SXM-80GB)",
        "a1:1 (A100-SXM-80GB)",
        "h0:1 (H100-SXM-80GB)",
    ]
    assert diff.iteration_time_s == (
        old.predicted["iteration_time_s"],
        new.predicted["iteration_time_s"],
    )
    assert main(["show", str(files / "new.json"), "--previous", str(files / "old.json")]) == 0
    text = capsys.readouterr().out
    for line in (
        "world size: 8 -> 5 (5 GPUs kept)",
        "ranks added: none",
        "predicted iteration time: ",
        "predicted tokens/s: ",
        "resume from its checkpoints: yes",
    ):
        assert line in text, text
    assert "h0:1 (H100-SXM-80GB)" in text
    assert (
        main(
            [
                "show",
                str(files / "old.json"),
                "--previous",
                str(files / "new.json"),
                "--format",
                "json",
            ]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)  # the GPUs come back: the other way round
    assert (
        doc["changes"]["world_size"] == [5, 8]
        and len(doc["changes"]["added"]) == 3
        and not doc["changes"]["gone"]
    )
    assert doc["changes"]["resumable"] and Layout.from_dict(doc["layout"]) == old
    assert main(["validate", str(files / "new.json"), "--previous", str(files / "old.json")]) == 0
    assert "world size: 8 -> 5" in capsys.readouterr().out


def test_plan_exclude_errors_leave_no_file(files, capsys):
    for exc, match in (
        ("x9:0", "has no host 'x9'"),
        ("h0:4", "host 'h0' has GPUs 0..3"),
        ("h0,a0,a1", "leaves no GPU"),
        ("h0:x", "cannot read 'h0:x'"),
    ):
        _error(
            capsys,
            [
                "plan",
                "--cluster",
                str(files / "c.yaml"),
                "--model",
                "gpt-3b",
                "--seq-length",
                "16384",
                "--exclude",
                exc,
                "-o",
                str(files / "out.json"),
            ],
            match,
        )
        assert not (files / "out.json").exists()


def test_validate_previous_refuses_what_cannot_resume(files, capsys):
    assert _plan(files, "old.json", "--memory-mode", "distributed_optimizer") == 0
    assert _plan(files, "seq.json", "--memory-mode", "distributed_optimizer", seq="32768") == 0
    assert _plan(files, "fsdp.json", "--memory-mode", "fsdp", "--exclude", "a1") == 0
    capsys.readouterr()
    _error(
        capsys,
        ["validate", str(files / "seq.json"), "--previous", str(files / "old.json")],
        "seq_length 16384 -> 32768 (re-plan with --seq-length 16384)",
    )
    _error(
        capsys,
        ["validate", str(files / "fsdp.json"), "--previous", str(files / "old.json")],
        "memory mode distributed_optimizer (torch_dist with the distributed optimizer) -> fsdp "
        "(fsdp_dtensor with Megatron-FSDP): re-plan with --memory-mode distributed_optimizer",
    )
    assert (
        main(["show", str(files / "fsdp.json"), "--previous", str(files / "old.json")]) == 0
    )  # show still shows
    assert "resume from its checkpoints: no: memory mode" in capsys.readouterr().out


def test_diff_of_hand_layouts_and_another_model():
    kw = dict(seq_length=16, num_attention_heads=4, num_query_groups=2)
    a = make_layout(
        **kw,
        group_sizes=[2],
        segments=[[(0, 8)], [(8, 16)]],
        heads=[[0, 1], [2, 3]],
        hosts=["n0", "n0"],
    )
    b = make_layout(**kw, group_sizes=[1], segments=[[(0, 16)]], heads=[[0, 1, 2, 3]], hosts=["n1"])
    d = diff_layouts(a, b)  # no predictions, no meta: nothing to compare but devices and shapes
    assert d.gone == ("n0:0 (CPU)", "n0:1 (CPU)") and d.added == ("n1:0 (CPU)",) and d.kept == 0
    assert d.iteration_time_s == (None, None) and not d.resume_problems
    assert "predicted iteration time: - -> -" in d.lines()
    c = make_layout(
        seq_length=16,
        num_attention_heads=8,
        num_query_groups=2,
        group_sizes=[1],
        segments=[[(0, 16)]],
        heads=[list(range(8))],
        hosts=["n1"],
    )
    assert diff_layouts(a, c).resume_problems == ("num_attention_heads 4 -> 8 (another model)",)
    spec = {"num_layers": 2, "hidden_size": 64}
    a2 = Layout.from_dict({**a.to_dict(), "meta": {"model_spec": spec}})
    b2 = Layout.from_dict({**a.to_dict(), "meta": {"model_spec": {**spec, "num_layers": 4}}})
    assert diff_layouts(a2, b2).resume_problems == ("model num_layers 2 -> 4 (another model)",)


def test_elastic_cli_writes_survivors(files, capsys):
    from megatron_hexiseq.elastic import main as elastic_main

    out = files / "s.yaml"
    assert (
        elastic_main(
            [
                "exclude",
                "--cluster",
                str(files / "c.yaml"),
                "--exclude",
                "h0:2,x9,a1",
                "--allow-absent",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    cap = capsys.readouterr()
    assert cap.out == "h0 0,1,3\n" and "--exclude x9: not in this allocation" in cap.err
    assert [
        (n.name, n.count)
        for n in cluster_from_dict(__import__("yaml").safe_load(out.read_text())).nodes
    ] == [("h0", 3), ("a0", 2)]
    assert (
        elastic_main(
            ["exclude", "--cluster", str(files / "c.yaml"), "--exclude", "x9", "-o", str(out)]
        )
        == 2
    )


# ---- checkpoint compatibility --------------------------------------------------------------------
def _args(**kw) -> argparse.Namespace:
    """Megatron-LM arguments as validate_args leaves them (the fields the record reads)."""
    base = dict(
        num_layers=32,
        hidden_size=4096,
        ffn_hidden_size=11008,
        num_attention_heads=32,
        group_query_attention=True,
        num_query_groups=8,
        kv_channels=128,
        padded_vocab_size=32000,
        swiglu=True,
        normalization="RMSNorm",
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
        num_experts=None,
        position_embedding_type="rope",
        seq_length=131072,
        world_size=16,
        context_parallel_size=16,
        data_parallel_size=1,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        ckpt_format="torch_dist",
        use_distributed_optimizer=True,
        use_megatron_fsdp=False,
        dist_ckpt_optim_fully_reshardable=False,
        overlap_grad_reduce=True,
        ddp_bucket_size=None,
        ddp_num_buckets=None,
        expert_model_parallel_size=1,
        data_parallel_random_init=False,
        save="/c",
        load="/c",
        non_persistent_ckpt_type=None,
        no_load_optim=None,
        no_load_rng=None,
        finetune=False,
        ckpt_step=None,
    )
    return argparse.Namespace(**{**base, **kw})


def _refused(saved: dict, now: dict, match: str, **kw) -> None:
    with pytest.raises(HexiSeqError, match=match) as e:
        ck.check_resume(
            ck.RunRecord.from_megatron_args(_args(**saved)),
            ck.RunRecord.from_megatron_args(_args(**now)),
            where="checkpoint c/iter_0000100",
            **kw,
        )
    assert "\n" not in str(e.value)


def _ok(saved: dict, now: dict, **kw) -> None:
    ck.check_resume(
        ck.RunRecord.from_megatron_args(_args(**saved)),
        ck.RunRecord.from_megatron_args(_args(**now)),
        **kw,
    )


def test_record_from_megatron_args():
    r = ck.RunRecord.from_megatron_args(_args())
    assert (
        r.optimizer_sharding == "dp_reshardable"
        and r.bucket_size == 40_000_000
        and r.dp_cp_size == 16
    )
    assert (
        ck.RunRecord.from_megatron_args(
            _args(world_size=64, context_parallel_size=32, data_parallel_size=2)
        ).bucket_size
        == 64_000_000
    )  # max(40M, 1M x DP x CP)
    assert ck.RunRecord.from_megatron_args(_args(overlap_grad_reduce=False)).bucket_size is None
    assert ck.RunRecord.from_megatron_args(_args(ddp_num_buckets=4)).num_buckets == 4
    assert (
        ck.RunRecord.from_megatron_args(
            _args(dist_ckpt_optim_fully_reshardable=True)
        ).optimizer_sharding
        == "fully_reshardable"
    )
    fsdp = ck.RunRecord.from_megatron_args(
        _args(use_megatron_fsdp=True, ckpt_format="fsdp_dtensor")
    )
    assert fsdp.optimizer_sharding == "fsdp_dtensor" and fsdp.planner_mode == "fsdp"
    assert (
        dict(ck.RunRecord.from_megatron_args(_args(group_query_attention=False)).model)[
            "num_query_groups"
        ]
        == 32
    )
    assert (
        ck.RunRecord.from_dict(r.to_dict()) == r
        and json.loads(json.dumps(r.to_dict())) == r.to_dict()
    )
    with pytest.raises(HexiSeqError, match="cannot read its run record"):
        ck.RunRecord.from_dict({**r.to_dict(), "colour": "red"})


def test_resume_across_world_sizes_is_allowed():
    _ok({}, dict(world_size=12, context_parallel_size=12))  # lost 4 GPUs: CP 16 -> 12
    _ok({}, dict(world_size=32, context_parallel_size=16, data_parallel_size=2))  # DP 1 -> 2
    _ok(
        dict(world_size=64, context_parallel_size=64),
        dict(world_size=48, context_parallel_size=48, ddp_bucket_size=64_000_000),
    )  # buckets pinned
    _ok(
        dict(world_size=64, context_parallel_size=64, dist_ckpt_optim_fully_reshardable=True),
        dict(world_size=48, context_parallel_size=48),
    )  # fully reshardable: buckets do not matter
    _ok(
        dict(use_distributed_optimizer=False),
        dict(
            use_distributed_optimizer=False,
            world_size=3,
            context_parallel_size=3,
            overlap_grad_reduce=False,
        ),
    )
    fsdp = dict(use_megatron_fsdp=True, ckpt_format="fsdp_dtensor")
    _ok(fsdp, {**fsdp, "world_size": 8, "context_parallel_size": 8})
    _ok(dict(seq_length=65536), {}, finetune=True)  # --finetune: weights only


def test_resume_refusals_name_the_mismatch():
    _refused({}, dict(num_layers=24), "holds a model with num_layers 32 but this run builds 24")
    _refused({}, dict(num_query_groups=4), "num_query_groups 8 but this run builds 4")
    _refused(
        {},
        dict(seq_length=65536),
        "trained with --seq-length 131072 but this run's layout is for 65536: "
        "re-plan the layout with --seq-length 131072",
    )
    _refused(
        {},
        dict(use_megatron_fsdp=True, ckpt_format="fsdp_dtensor"),
        "torch_dist checkpoint .distributed optimizer. but this run uses --ckpt-format fsdp_dtensor "
        ".Megatron-FSDP.; neither reads the other: re-plan with --memory-mode distributed_optimizer",
    )
    _refused(
        dict(use_megatron_fsdp=True, ckpt_format="fsdp_dtensor"),
        {},
        "re-plan with --memory-mode fsdp",
    )
    _refused(
        {},
        dict(use_distributed_optimizer=False),
        "optimizer state of a distributed optimizer but this run "
        "uses a DDP with a regular optimizer",
    )
    _ok({}, dict(use_distributed_optimizer=False), load_optim=False)
    _refused(
        dict(world_size=64, context_parallel_size=64),
        dict(world_size=48, context_parallel_size=48),
        r"per gradient bucket of 64,000,000 parameters but this run's buckets hold 48,000,000 parameters: "
        "pass --ddp-bucket-size 64000000",
    )
    _ok(
        dict(world_size=64, context_parallel_size=64),
        dict(world_size=48, context_parallel_size=48),
        load_optim=False,
    )
    _refused({}, dict(overlap_grad_reduce=False), "one bucket .no --overlap-grad-reduce.")
    _refused(dict(ddp_num_buckets=3), {}, "pass --ddp-num-buckets 3")
    _refused(
        {},
        dict(pipeline_model_parallel_size=2, world_size=32),
        r"TP x PP changes from \(1, 1\) to \(1, 2\)",
    )
    _refused(
        dict(expert_model_parallel_size=2),
        dict(expert_model_parallel_size=2, world_size=12, context_parallel_size=12),
        "pass --no-load-rng",
    )
    _ok(
        dict(expert_model_parallel_size=2),
        dict(expert_model_parallel_size=2, world_size=12, context_parallel_size=12),
        load_rng=False,
    )
    _refused(
        dict(data_parallel_random_init=True, world_size=32, data_parallel_size=2),
        dict(data_parallel_random_init=True),
        "one RNG state per data-parallel rank .2., this run has 1",
    )


def test_checkpoint_options_refused_for_hexiseq_runs():
    for kw, match in (
        (dict(ckpt_format="torch"), "legacy format"),
        (dict(ckpt_format="torch_dcp"), "use-torch-fsdp2"),
        (dict(non_persistent_ckpt_type="local"), "--non-persistent-ckpt-type local"),
    ):
        with pytest.raises(HexiSeqError, match=match):
            ck.check_options(_args(**kw))
        ck.check_options(_args(**kw, save=None, load=None))  # without checkpoints nothing to refuse
    ck.check_options(_args())


def test_find_checkpoint(tmp_path):
    assert ck.find_checkpoint(str(tmp_path)) is None  # nothing saved yet: a fresh start
    (tmp_path / ck.TRACKER).write_text("120\n")
    assert ck.find_checkpoint(str(tmp_path)) == str(tmp_path / "iter_0000120")
    (tmp_path / ck.TRACKER).write_text("release")
    assert ck.find_checkpoint(str(tmp_path)) == str(tmp_path / "release")
    (tmp_path / "iter_0000007").mkdir()
    assert ck.find_checkpoint(str(tmp_path), step=7) == str(tmp_path / "iter_0000007")
    assert ck.find_checkpoint(str(tmp_path), step=8) is None
    (tmp_path / ck.TRACKER).write_text("twelve")
    with pytest.raises(HexiSeqError, match="should hold an iteration number"):
        ck.find_checkpoint(str(tmp_path))


def test_read_record_of_dcp_legacy_and_missing(tmp_path):
    """torch DCP (fsdp_dtensor) checkpoints: the pickled args are read without the tensors."""
    import torch
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "iter_0000005"
    args = _args(use_megatron_fsdp=True, ckpt_format="fsdp_dtensor", seq_length=4096)
    dcp.save({"args": args, "model": {"w": torch.ones(3)}}, checkpoint_id=str(folder), no_dist=True)
    (tmp_path / ck.TRACKER).write_text("5")
    assert ck.read_record(str(folder)) == ck.RunRecord.from_megatron_args(args)
    with pytest.raises(HexiSeqError, match="trained with --seq-length 4096"):
        ck.check_before_training(
            _args(use_megatron_fsdp=True, ckpt_format="fsdp_dtensor", load=str(tmp_path))
        )
    legacy = tmp_path / "legacy"
    (legacy / "mp_rank_00").mkdir(parents=True)
    with pytest.raises(HexiSeqError, match="legacy torch format"):
        ck.read_record(str(legacy))
    with pytest.raises(HexiSeqError, match="is not a Megatron checkpoint"):
        ck.read_record(str(tmp_path))
    with pytest.raises(HexiSeqError, match="does not exist"):
        ck.read_record(str(tmp_path / "iter_0000009"))


def test_plugin_setup_checks_the_checkpoint_before_building_anything(tmp_path):
    """``plugin.setup`` (the model provider's first call) refuses before ``build_runtime``: no process
    group exists here, so reaching it would fail differently."""
    import torch.distributed.checkpoint as dcp

    from megatron_hexiseq.megatron import plugin

    layout = make_layout(
        seq_length=16,
        num_attention_heads=32,
        num_query_groups=8,
        group_sizes=[1],
        segments=[[(0, 16)]],
        heads=[list(range(32))],
    )
    layout.save(tmp_path / "layout.json")
    saved = _args(seq_length=4096, use_megatron_fsdp=True, ckpt_format="fsdp_dtensor")
    dcp.save({"args": saved}, checkpoint_id=str(tmp_path / "ckpt" / "iter_0000009"), no_dist=True)
    (tmp_path / "ckpt" / ck.TRACKER).write_text("9")
    run = dict(
        hexiseq_layout=str(tmp_path / "layout.json"),
        cp_comm_type=["hexiseq"],
        hexiseq_overlap_configured=True,
        seq_length=16,
        world_size=1,
        context_parallel_size=1,
        use_megatron_fsdp=True,
        ckpt_format="fsdp_dtensor",
        load=str(tmp_path / "ckpt"),
    )
    with pytest.raises(
        HexiSeqError,
        match=r"iter_0000009 was trained with --seq-length 4096 but this run's layout "
        "is for 16",
    ):
        plugin.setup(_args(**run), None, cp_group=object())
    with pytest.raises(HexiSeqError, match="legacy format"):
        plugin.setup(_args(**{**run, "ckpt_format": "torch"}), None, cp_group=object())


READ_FROM_ARGS = (
    *[f for f in ck.MODEL_FIELDS if f != "padded_vocab_size"],
    "group_query_attention",
    "seq_length",
    "world_size",
    "context_parallel_size",
    "data_parallel_size",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "ckpt_format",
    "use_distributed_optimizer",
    "use_megatron_fsdp",
    "dist_ckpt_optim_fully_reshardable",
    "overlap_grad_reduce",
    "ddp_bucket_size",
    "ddp_num_buckets",
    "expert_model_parallel_size",
    "data_parallel_random_init",
    "save",
    "load",
    "ckpt_step",
    "no_load_optim",
    "no_load_rng",
    "finetune",
    "non_persistent_ckpt_type",
)


@pytest.mark.skipif(
    not __import__("os").environ.get("MEGATRON_LM"),
    reason="set MEGATRON_LM=<core_v0.16.1 checkout>",
)
def test_record_reads_real_megatron_lm_arguments():
    """Every argument the record reads exists in Megatron-LM's parsed + validated args (a renamed one
    would silently take a default), and the bucket rule follows Megatron's default size."""
    from test_megatron_lm_seq_length import _validate

    def real(world: int, *extra: str) -> argparse.Namespace:
        return _validate(
            [
                "--seq-length",
                "48",
                "--max-position-embeddings",
                "48",
                "--context-parallel-size",
                str(world),
                "--cp-comm-type",
                "hexiseq",
                "--hexiseq-layout",
                "l.json",
                "--use-distributed-optimizer",
                "--overlap-grad-reduce",
                *extra,
            ],
            world=world,
        )

    big = real(64)
    assert [name for name in READ_FROM_ARGS if not hasattr(big, name)] == []
    r64 = ck.RunRecord.from_megatron_args(big)
    assert (r64.bucket_size, r64.optimizer_sharding, r64.ckpt_format) == (
        64_000_000,
        "dp_reshardable",
        "torch_dist",
    )
    with pytest.raises(HexiSeqError, match="pass --ddp-bucket-size 64000000"):
        ck.check_resume(r64, ck.RunRecord.from_megatron_args(real(48)))
    ck.check_resume(r64, ck.RunRecord.from_megatron_args(real(48, "--ddp-bucket-size", "64000000")))
