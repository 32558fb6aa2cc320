"""Megatron plugin glue: layer (a) (flags provider, overlap hook, forward-step wrapper, imports
without TE/Apex) and layer (b) (the model provider on 4 gloo ranks with stand-ins for Megatron-LM's
``model_provider``/``gpt_builders``; its model's per-token loss equals the single-process model's).
The same path against a real Megatron-LM checkout: tests/test_megatron_lm.py.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import types

import pytest
import torch

from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import make_layout
from megatron_hexiseq.megatron import plugin
from megatron_hexiseq.megatron.config import transformer_config
from megatron_hexiseq.testbed.spawn import run_ranks
from megatron_hexiseq.testbed.train import TrainConfig, reference_rank_many

LAYOUT = make_layout(
    seq_length=48,
    num_attention_heads=8,
    num_query_groups=2,
    group_sizes=[3, 1],
    segments=[[(0, 6), (40, 44)], [(6, 16)], [(16, 22), (44, 48)], [(22, 40)]],
    heads=[[0, 1, 2], [3, 4, 5, 6], [7], list(range(8))],
)
CFG = TrainConfig(layout=LAYOUT, steps=1)


# ---- layer (a) -------------------------------------------------------------------------------
def test_package_imports_without_te_or_apex():
    code = (
        "import sys\n"
        "for m in ('transformer_engine', 'apex', 'flash_attn'): sys.modules[m] = None\n"
        "import megatron_hexiseq.megatron.plugin, megatron_hexiseq.megatron.spec, "
        "megatron_hexiseq.testbed.train, megatron_hexiseq.megatron.launch, megatron_hexiseq.pretrain_gpt\n"
        "from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec\n"
        "print('ok')\n"
    )
    res = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_post_parse_hook_configures_overlap_once(monkeypatch):
    calls = []
    monkeypatch.setattr(
        plugin.megatron_hooks,
        "configure_from_args",
        lambda args: calls.append(args.hexiseq_overlap_config),
    )
    parser = plugin.extra_args_provider(None)(argparse.ArgumentParser())
    args = parser.parse_args(["--hexiseq-overlap-config", "tune.json"])
    assert calls == ["tune.json"] and args.hexiseq_overlap_configured
    plugin.configure_overlap(args)  # setup() calls it again: no second application
    assert calls == ["tune.json"]


def _megatron_parser() -> argparse.ArgumentParser:
    """The plugin's provider on a parser with the Megatron-LM flags its post-parse hook reads
    (names, destinations and defaults as core_v0.16.1 declares them)."""
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--no-create-attention-mask-in-dataloader",
        action="store_false",
        dest="create_attention_mask_in_dataloader",
    )
    parser.add_argument("--seq-length", type=int)
    parser.add_argument("--micro-batch-size", type=int)
    parser.add_argument("--cuda-graph-impl", default="none")
    parser.add_argument("--enable-cuda-graph", action="store_true")
    parser.add_argument("--external-cuda-graph", action="store_true")
    parser.add_argument("--rope-type", choices=["rope", "yarn"])
    parser.add_argument("--position-embedding-type", default="learned_absolute")
    return plugin.extra_args_provider(None)(parser)


def test_post_parse_hook_drops_the_dataloader_mask_and_says_so_on_rank_zero(monkeypatch, capsys):
    hexiseq = ["--hexiseq-layout", "l.json", "--seq-length", "131072", "--micro-batch-size", "2"]
    monkeypatch.setenv("RANK", "0")
    args = _megatron_parser().parse_args(hexiseq)
    assert args.create_attention_mask_in_dataloader is False
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "hexiseq: not building the dataloader's attention mask "
        "(--no-create-attention-mask-in-dataloader): HexiSeq attention never reads it "
        "(it would take 32.0 GiB per GPU: [mbs, 1, S, S] bool)"
    ]
    monkeypatch.setenv("RANK", "3")  # other ranks: the same decision, silently
    assert _megatron_parser().parse_args(hexiseq).create_attention_mask_in_dataloader is False
    monkeypatch.setenv("RANK", "0")  # already off: nothing to say
    args = _megatron_parser().parse_args(hexiseq + ["--no-create-attention-mask-in-dataloader"])
    assert args.create_attention_mask_in_dataloader is False
    assert _megatron_parser().parse_args([]).create_attention_mask_in_dataloader  # stock: as is
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            "--cuda-graph-impl local",
            "--cuda-graph-impl local: HexiSeq attention does not run "
            "inside CUDA graphs yet; drop --cuda-graph-impl local (or run without --hexiseq-layout)",
        ),
        ("--cuda-graph-impl transformer_engine", "drop --cuda-graph-impl transformer_engine"),
        ("--enable-cuda-graph", "--enable-cuda-graph: HexiSeq attention does not run inside"),
        ("--external-cuda-graph", "drop --external-cuda-graph"),
        (
            "--rope-type yarn",
            "--rope-type yarn: HexiSeq's layout RoPE does not implement YaRN "
            "yet; use --rope-type rope",
        ),
        ("--position-embedding-type yarn", "position_embedding_type yarn: HexiSeq's layout RoPE"),
    ],
)
def test_post_parse_hook_refuses_cuda_graphs_and_yarn(flags, message):
    parser = _megatron_parser()
    with pytest.raises(HexiSeqError) as err:
        parser.parse_args(["--hexiseq-layout", "l.json", *flags.split()])
    assert message in str(err.value) and "\n" not in str(err.value)
    parser.parse_args(flags.split())  # a stock run keeps the flag


def test_setup_decides_again_on_the_final_args(tmp_path, capsys):
    """``--yaml-cfg`` replaces Megatron's parsed args after the post-parse hook: ``setup`` (before
    any collective, before the datasets) refuses and drops the mask on the final args too."""
    yaml_args = argparse.Namespace(
        hexiseq_layout=str(tmp_path / "missing.json"),
        hexiseq_overlap_configured=True,
        position_embedding_type="yarn",
    )
    with pytest.raises(HexiSeqError, match="position_embedding_type yarn: HexiSeq's layout RoPE"):
        plugin.setup(yaml_args, None)
    yaml_args.position_embedding_type = "rope"
    yaml_args.create_attention_mask_in_dataloader = True
    with pytest.raises(HexiSeqError, match="does not exist"):  # the layout file, read after
        plugin.setup(yaml_args, None, cp_group=object())
    assert yaml_args.create_attention_mask_in_dataloader is False
    assert "not building the dataloader's attention mask" in capsys.readouterr().out


def test_cp_comm_type_hexiseq_needs_a_layout():
    args = argparse.Namespace(cp_comm_type=["hexiseq"], hexiseq_overlap_configured=True)
    with pytest.raises(HexiSeqError, match="--cp-comm-type hexiseq needs --hexiseq-layout"):
        plugin.setup(args, None)
    assert (
        plugin.setup(
            argparse.Namespace(cp_comm_type=["p2p"], hexiseq_overlap_configured=True), None
        )
        is None
    )


def test_forward_step_wrapper_hands_online_tuning_to_the_tuning_step():
    from megatron_hexiseq.megatron.core_attention import HexiSeqCoreAttention
    from megatron_hexiseq.overlap.megatron_hooks import OnlineTuningStep

    cores = [HexiSeqCoreAttention.__new__(HexiSeqCoreAttention) for _ in range(3)]
    model = torch.nn.Module()
    for i, c in enumerate(cores):
        torch.nn.Module.__init__(c)
        c.comm_chunks = 3
        model.add_module(f"core{i}", c)
    seen = []
    plain = plugin.forward_step(
        lambda it, m: seen.append([c.comm_chunks for c in cores]) or "out",
        get_args=lambda: argparse.Namespace(hexiseq_overlap_tune=False),
    )
    assert plain(None, model) == "out" and plain._inner is plain.forward_step
    args = argparse.Namespace(hexiseq_overlap_tune=True, hexiseq_layout="layout.json", save=None)
    tuned = plugin.forward_step(
        lambda it, m: seen.append([c.comm_chunks for c in cores]) or "x", get_args=lambda: args
    )
    finalized = []
    model.config = types.SimpleNamespace(  # what Megatron's train() sets before the first step
        finalize_model_grads_func=lambda models, n, **kw: finalized.append(n)
    )
    assert tuned(None, model) == "x" and isinstance(tuned._inner, OnlineTuningStep)
    model.config.finalize_model_grads_func([model], 7, pg_collection=None)  # end of iteration 1
    assert tuned(None, model) == "x" and finalized == [7]
    assert seen == [
        [3, 3, 3],
        [3, 3, 3],
        [1, 1, 1],
    ]  # the tuner's first configuration reached every core attention at the iteration's end
    assert plugin.set_comm_chunks(model, 1) == 0 and plugin.set_comm_chunks([model], 2) == 3


# ---- layer (b) -------------------------------------------------------------------------------
def _get_transformer_layer_spec(
    use_te, config
):  # stands in for gpt_builders._get_transformer_layer_spec
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    assert not use_te
    return get_gpt_layer_local_spec(normalization="RMSNorm")


def _stock_gpt_builder(*args, **kwargs):  # the stock builder: must not be called with a layout
    raise AssertionError("stock gpt_builder called although --hexiseq-layout is set")


def _stock_model_provider(
    builder, pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None
):  # Megatron-LM's model_provider(model_builder, ...)
    return builder(
        _ARGS[0], pre_process, post_process, vp_stage, config=config, pg_collection=pg_collection
    )


_ARGS: list = []


def _megatron_args(layout_path: str, **changes) -> argparse.Namespace:
    parser = plugin.extra_args_provider(None)(argparse.ArgumentParser())
    args = parser.parse_args(["--hexiseq-layout", layout_path, "--hexiseq-kernel", "reference"])
    vars(args).update(
        dict(
            world_size=4,
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
            context_parallel_size=4,
            seq_length=48,
            num_attention_heads=8,
            num_query_groups=2,
            group_query_attention=True,
            cp_comm_type=["hexiseq"],
            calculate_per_token_loss=True,
            create_attention_mask_in_dataloader=False,
            use_legacy_models=False,
            spec=None,
            transformer_impl="local",
            num_experts=None,
            padded_vocab_size=128,
            max_position_embeddings=48,
            fp16_lm_cross_entropy=False,
            untie_embeddings_and_output_weights=True,
            position_embedding_type="rope",
            rotary_percent=1.0,
            rotary_base=10000,
            use_rope_scaling=False,
        )
    )
    vars(args).update(changes)
    return args


def _plugin_worker(rank: int, world: int, layout_path: str) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_hexiseq.megatron.core_attention import HexiSeqCoreAttention
    from megatron_hexiseq.megatron.loss import per_token_loss
    from megatron_hexiseq.megatron.rope import LayoutRotaryEmbedding
    from megatron_hexiseq.testbed.train import make_batch

    out: dict = {}
    mpu.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=4)
    try:  # a start-up mismatch: the run expects 8 processes, 4 joined
        plugin.setup(_megatron_args(layout_path, world_size=8), None)
    except HexiSeqError as e:
        out["error"] = str(e)
    _ARGS[:] = [_megatron_args(layout_path)]
    pretrain_module = types.ModuleType("pretrain_gpt_standin")
    provider = plugin.model_provider(
        _stock_model_provider, _stock_gpt_builder, pretrain_module, get_args=lambda: _ARGS[0]
    )
    torch.manual_seed(CFG.seed)  # the reference's weights
    model = provider(
        pre_process=True,
        post_process=True,
        config=transformer_config(CFG.model, context_parallel_size=4),
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    out["cores"] = sum(isinstance(m, HexiSeqCoreAttention) for m in model.modules())
    out["rope"] = isinstance(model.rotary_pos_emb, LayoutRotaryEmbedding)
    # what pretrain_gpt.get_batch does: the prepared batch, then the slicer (passing it through)
    batch = pretrain_module.get_batch_on_this_cp_rank(
        pretrain_module.get_batch_on_this_tp_rank(iter([make_batch(CFG, 0, 0)]))
    )
    logits_losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    loss_sum, n = per_token_loss(logits_losses, batch["loss_mask"])
    both = torch.stack([loss_sum.detach(), n.float()])
    dist.all_reduce(both)
    out["loss"] = float(both[0] / both[1])
    mpu.destroy_model_parallel()
    return out


def test_model_provider_on_gloo_matches_reference(tmp_path):
    path = tmp_path / "layout.json"
    LAYOUT.save(path)
    results = run_ranks(_plugin_worker, 4, str(path), timeout_s=600)
    ref = run_ranks(reference_rank_many, 1, [CFG], timeout_s=600)[0][0]
    for res in results:
        assert "4 processes joined but the run expects 8" in res["error"]
        assert res["cores"] == 4 and res["rope"]
        assert res["loss"] == pytest.approx(ref.losses[0], rel=1e-5)
