"""The functions both ways of running Megatron-LM's ``pretrain_gpt.py`` end in.

1. ``patches/megatron-lm-core_v0.16.1.patch`` makes ``pretrain_gpt.py`` call
   ``plugin.help_with_hexiseq_flags(<its own provider>)`` (``--help`` lists our flags) and pass
   ``plugin.model_provider(model_provider, gpt_builder, <its module>)``,
   ``plugin.forward_step(forward_step)`` and ``plugin.extra_args_provider(<its own provider>)``
   to ``pretrain``;
2. ``python -m megatron_hexiseq.pretrain_gpt <Megatron args>`` imports the unpatched
   ``pretrain_gpt`` module and calls ``run_pretrain(module)``, which does the same.

Order of events inside Megatron's ``pretrain``:
``parse_args(extra_args_provider)``: our ``--hexiseq-*`` flags; right after argparse has parsed,
a post-parse hook on that parser refuses what a HexiSeq run does not support yet (CUDA graphs,
YaRN: ``post_parse.refuse_unsupported``), hands a HexiSeq run's ``--seq-length`` to
``validate_args`` as ``encoder_seq_length`` when it is not a multiple of 2 x CP
(``defer_seq_length_check``), turns the dataloader's dense attention mask off
(``post_parse.drop_dataloader_mask``), and calls the overlap tuner's
``megatron_hexiseq.overlap.megatron_hooks.configure_from_args(args)`` (before ``validate_args``
and before the process groups exist, so bucket size and NCCL options take effect) ->
``validate_args`` -> ``initialize_model_parallel`` (CP size = layout world size) -> ``get_model``
calls our model provider, whose FIRST call (on every rank) runs ``setup``: layout load + the
checkpoint check (``checkpoint.check_before_training``: the checkpoint ``--load`` resumes must be of
this model, sequence length and memory mode) + start-up checks + groups (``build_runtime``,
collective), and replaces
``pretrain_gpt.get_batch_on_this_cp_rank`` with the layout's slicer. Every call builds the GPT
through ``build_gpt_model``: the stock layer spec with ``HexiSeqCoreAttention`` swapped in, RoPE at
this rank's global positions. During training, with ``--hexiseq-overlap-tune``, our
``forward_step`` wrapper owns the online tuner
(``megatron_hooks.OnlineTuningStep``): it hooks the end of every training iteration (Megatron's
``finalize_model_grads_func``), times iterations there and puts the ``comm_chunks`` it chooses into
the core-attention modules. Without ``--hexiseq-layout`` everything is stock Megatron.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from megatron_hexiseq.attention.groups import HexiSeqGroups
from megatron_hexiseq.errors import HexiSeqError, run_user_command
from megatron_hexiseq.job import JobPlan
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.megatron import job_plugin, post_parse
from megatron_hexiseq.megatron.args import (
    CP_COMM_TYPE,
    HexiSeqArgs,
    add_hexiseq_args,
    job_flag,
    layout_flag,
)
from megatron_hexiseq.megatron.batch import LayoutBatchSlicer
from megatron_hexiseq.megatron.batch_layout import (
    BatchLayouts,
    MicroBatchLayout,
    batch_planner_layouts,
)
from megatron_hexiseq.megatron.checkpoint import check_before_training
from megatron_hexiseq.megatron.core_attention import HexiSeqCoreAttention
from megatron_hexiseq.megatron.documents import MicroBatchDocuments
from megatron_hexiseq.megatron.job_runtime import domain_process_ranks
from megatron_hexiseq.megatron.params_check import megatron_replica_groups, share_initial_parameters
from megatron_hexiseq.megatron.rope import install_rope
from megatron_hexiseq.megatron.runtime import HexiSeqRuntime, RunShape, build_runtime
from megatron_hexiseq.megatron.spec import hexiseq_spec
from megatron_hexiseq.overlap import megatron_hooks

if TYPE_CHECKING:  # annotations only: megatron.core's model modules are heavy to import
    import torch.distributed as dist
    from megatron.core.models.gpt import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig


def extra_args_provider(
    chain: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None = None,
) -> Callable[[argparse.ArgumentParser], argparse.ArgumentParser]:
    """Megatron ``extra_args_provider``: the ``--hexiseq-*`` flags, ``chain``'s flags, post-parse hook."""

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser = add_hexiseq_args(parser, chain=chain)
        _after_parse(parser, after_parse)
        return parser

    return provider


def _after_parse(
    parser: argparse.ArgumentParser, hook: Callable[[argparse.Namespace], None]
) -> None:
    """Run ``hook(args)`` whenever this parser instance finishes parsing (``parse_args`` and
    ``parse_known_args`` both go through ``parse_known_args``)."""
    parse_known_args = parser.parse_known_args

    def parse_and_hook(*args: Any, **kwargs: Any) -> tuple[argparse.Namespace, list[str]]:
        namespace, rest = parse_known_args(*args, **kwargs)
        hook(namespace)
        return namespace, rest

    # one parser instance's bound method, replaced by a wrapper of the same behaviour
    parser.parse_known_args = parse_and_hook  # type: ignore[method-assign,assignment]


def after_parse(args: argparse.Namespace) -> None:
    """The post-parse hook: ``post_parse.refuse_unsupported``, ``defer_seq_length_check``,
    ``post_parse.drop_dataloader_mask``, then ``configure_overlap``."""
    post_parse.refuse_unsupported(args)
    defer_seq_length_check(args)
    post_parse.drop_dataloader_mask(args)
    configure_overlap(args)


def check_layout_flag(argv: Sequence[str]) -> None:
    """``--hexiseq-layout`` / ``--hexiseq-job`` in ``argv`` name a readable, valid layout / job,
    else one line on stderr and exit 2: before ``pretrain`` parses the flags and
    ``initialize_megatron`` starts the process group (a typo would otherwise cost the distributed
    start-up of every rank)."""
    path, job = layout_flag(list(argv)), job_flag(list(argv))
    if path is None and job is None:
        return

    def check() -> None:
        if path is not None:
            Layout.load(path)
        if job is not None:
            JobPlan.load(job)

    rc = run_user_command(check, interrupts=False)
    if rc:
        sys.exit(rc)


def defer_seq_length_check(args: argparse.Namespace) -> None:
    """Let ``validate_args`` accept a HexiSeq sequence length that is not a multiple of 2 x CP.

    Megatron-LM's ``validate_args`` (core_v0.16.1) asserts ``seq_length % (2 * context_parallel_size)
    == 0`` for its even zig-zag split, which a HexiSeq layout does not use (any length splits). The
    assert runs only when ``seq_length`` is set; right after it, ``validate_args`` copies
    ``encoder_seq_length`` into ``seq_length`` when ``seq_length`` is None. So for a HexiSeq run
    (``--hexiseq-layout`` or ``--hexiseq-job``, and ``--cp-comm-type hexiseq``) whose length fails
    that assert, this moves the value to ``encoder_seq_length``; ``validate_args`` then restores
    it, with every other check on ``seq_length`` (max position embeddings, ...) still applied.
    Stock runs are untouched.
    """
    cp = getattr(args, "context_parallel_size", 1) or 1
    seq = getattr(args, "seq_length", None)
    if (
        post_parse.is_hexiseq_run(args)
        and CP_COMM_TYPE in _cp_comm_types(args)
        and cp > 1
        and seq is not None
        and seq % (2 * cp)
        and getattr(args, "encoder_seq_length", None) is None
    ):
        args.encoder_seq_length, args.seq_length = seq, None


def configure_overlap(args: argparse.Namespace) -> None:
    """Call the overlap tuner's ``configure_from_args(args)`` once (before the model and DDP exist)."""
    if getattr(args, "hexiseq_overlap_configured", False):
        return
    args.hexiseq_overlap_configured = True
    megatron_hooks.configure_from_args(args)


def _cp_comm_types(args: argparse.Namespace) -> set[str]:
    value = getattr(args, "cp_comm_type", None)
    if value is None:
        return set()
    return set(value) if isinstance(value, (list, tuple)) else {value}


def setup(
    args: argparse.Namespace,
    pretrain_module: ModuleType | None,
    *,
    cp_group: dist.ProcessGroup | None = None,
    batch_layouts: BatchLayouts | None = None,
    training_module: ModuleType | None = None,
) -> HexiSeqRuntime | None:
    """Once per process, after ``initialize_model_parallel``: returns the ``HexiSeqRuntime`` or None.

    Collective over the default group when ``--hexiseq-layout`` or ``--hexiseq-job`` is given
    (a job: this process's domain's runtime, every domain's groups; ``megatron/job_plugin.py``).
    ``batch_layouts``: a per-micro-batch layout provider (``megatron/batch_layout.py``;
    deterministic, the layout's groups and heads): every micro-batch then runs its own layout on
    the groups. ``training_module``: Megatron-LM's ``megatron.training.training``, whose schedule
    and data-loader seams a job (and ``--hexiseq-check-params N``) replaces; imported when
    ``pretrain_module`` is given, left alone when both are None.
    """

    configure_overlap(args)  # no-op when the post-parse hook ran already
    # again on the final args: no-ops after the post-parse hook, but --yaml-cfg replaces the parsed
    # args (after the hook); the datasets are built after the model, so the mask is still in time
    post_parse.refuse_unsupported(args)
    post_parse.drop_dataloader_mask(args)
    hs = HexiSeqArgs.from_namespace(
        args
    )  # after it: the overlap hook may set --hexiseq-comm-chunks
    if not hs.enabled:
        if CP_COMM_TYPE in _cp_comm_types(args):
            raise HexiSeqError(
                f"--cp-comm-type {CP_COMM_TYPE} needs --hexiseq-layout PATH or --hexiseq-job PATH "
                "(plan one with 'megatron-hexiseq plan')"
            )
        return None
    place = job = None
    if hs.job is not None:
        check_before_training(args)  # --save/--load settings, and the checkpoint --load resumes
        runtime, place, job = job_plugin.setup_job(args, hs)
        source = f"job {hs.job} domain {place.domain}"
    else:
        from megatron.core import parallel_state as mpu

        if cp_group is None:
            cp_group = mpu.get_context_parallel_group()
        tp = getattr(args, "tensor_model_parallel_size", 1) or 1
        assert hs.layout is not None
        source = f"layout {hs.layout}"
        layout = Layout.load(hs.layout)
        check_before_training(
            args
        )  # --save/--load settings, and the checkpoint --load resumes (rank 0 reads it)
        runtime = build_runtime(
            layout,
            RunShape.from_megatron_args(args),
            cp_group=cp_group,
            source=source,
            tp_group=mpu.get_tensor_model_parallel_group() if tp > 1 else None,
            **job_plugin.runtime_options(args, hs),
        )
    layout = runtime.layout
    runtime = replace(runtime, documents=micro_batch_documents(args, layout.seq_length))
    if hs.global_batch:  # every micro-batch is planned by the global-batch path (global_ahead.py)
        from megatron_hexiseq.megatron.global_ahead import global_slot

        if batch_layouts is not None:
            raise HexiSeqError(
                "--hexiseq-global-batch plans every micro-batch itself; drop the "
                "per-micro-batch layout provider"
            )
        slot = global_slot(  # with TP bundles the scheme rounds every layout to multiples of t
            runtime.groups,
            reset_position_ids=bool(getattr(args, "reset_position_ids", False)),
            tokens_multiple_of=layout.tensor_model_parallel_size,
        )
        runtime = replace(runtime, batch_layout=slot)
    elif hs.batch_plan:
        if batch_layouts is not None:
            raise HexiSeqError(
                "--hexiseq-batch-plan and a per-micro-batch layout provider were both given; "
                "use one"
            )
        batch_layouts = batch_planner_layouts(layout, source)
    if batch_layouts is not None:
        runtime = replace(
            runtime, batch_layout=micro_batch_layout(args, runtime.groups, batch_layouts)
        )
    if pretrain_module is not None:
        domains = [sorted(d) for d in domain_process_ranks(job)] if job is not None else None
        ahead = None
        if hs.global_batch:
            from megatron_hexiseq.megatron.global_ahead import (
                every_rank_builds_datasets,
                run_global_batches,
            )

            ahead = run_global_batches(
                args, runtime, cp_group=cp_group, job=job, place=place, source=source
            )
            if layout.tensor_model_parallel_size > 1:  # every TP rank reads the step's samples
                seam = every_rank_builds_datasets
                pretrain_module.is_dataset_built_on_rank = seam  # type: ignore[attr-defined]
        runtime = install_batch_seams(args, runtime, pretrain_module, cp_group, domains, ahead)
        if training_module is None and (job is not None or hs.check_params or hs.global_batch):
            from megatron.training import training

            training_module = training
    if training_module is not None:  # the training loop's seams: a job, the parameter check
        job_plugin.install_training_seams(training_module, args, hs, place=place, job=job)
        if hs.global_batch:  # every rank reads every step's whole global batch
            from megatron_hexiseq.megatron.global_ahead import global_data_loaders

            loaders = global_data_loaders(args)
            training_module.build_pretraining_data_loader = loaders  # type: ignore[attr-defined]
    return runtime


def install_batch_seams(
    args: argparse.Namespace,
    runtime: HexiSeqRuntime,
    pretrain_module: ModuleType,
    cp_group: dist.ProcessGroup | None,
    domains: list[list[int]] | None = None,
    ahead: Callable[..., dict[str, Any]] | None = None,
) -> HexiSeqRuntime:
    """Replace ``pretrain_gpt``'s batch functions (the batch seams, on purpose). Without pipeline
    and tensor parallelism every micro-batch is prepared ahead off the training thread
    (``batch_ahead``: boundaries from the CPU batch, plan, host slices, agreement checks over the
    CP domains, or a job's ``domains`` of process ranks; ``ahead``: a ready
    ``get_batch_on_this_tp_rank``, the global-batch path's, which every TP rank runs alike) and
    ``get_batch`` only copies;
    otherwise (middle pipeline stages, TP ranks that receive the batch by broadcast) the slicer
    slices on the device as before."""
    reset_mask = bool(getattr(args, "reset_attention_mask", False))
    one_stage = (getattr(args, "pipeline_model_parallel_size", 1) or 1) == 1
    prepared = one_stage and (
        ahead is not None or (getattr(args, "tensor_model_parallel_size", 1) or 1) == 1
    )
    assert ahead is None or one_stage, "the global-batch path needs PP = 1 (packed_checks)"
    if prepared:
        from megatron_hexiseq.megatron.batch_ahead import ahead_batches, micro_batches_per_step
        from megatron_hexiseq.megatron.batch_layout import fixed_layout

        if runtime.batch_layout is None:
            runtime = replace(
                runtime,
                batch_layout=fixed_layout(
                    runtime.groups,
                    reset_position_ids=bool(getattr(args, "reset_position_ids", False)),
                ),
            )
        assert runtime.batch_layout is not None and runtime.documents is not None
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        if ahead is None:
            ahead = ahead_batches(
                runtime.documents,
                runtime.batch_layout,
                reset_attention_mask=reset_mask,
                cp_group=cp_group,
                domains=domains,
                depth=micro_batches_per_step(),
                device=device,
            )
        pretrain_module.get_batch_on_this_tp_rank = ahead  # type: ignore[attr-defined]
    slicer = LayoutBatchSlicer(
        runtime.segments,
        runtime.layout.seq_length,
        runtime.documents,
        reset_attention_mask=reset_mask,
        batch_layout=runtime.batch_layout,
        prepared=prepared,
    )
    pretrain_module.get_batch_on_this_cp_rank = slicer  # type: ignore[attr-defined]
    pretrain_module.get_thd_batch_on_this_cp_rank = slicer.thd  # type: ignore[attr-defined]
    return runtime


def micro_batch_documents(args: argparse.Namespace, seq_length: int) -> MicroBatchDocuments:
    """The document slot of a HexiSeq run: boundaries from EOD tokens with
    ``--reset-attention-mask``, from THD ``cu_seqlens`` otherwise (see megatron/documents.py)."""
    reset_mask = bool(getattr(args, "reset_attention_mask", False))
    if reset_mask and (getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1:
        raise HexiSeqError(
            "--reset-attention-mask with --hexiseq-layout does not support pipeline parallelism "
            "yet (middle stages do not load the batch); use --pipeline-model-parallel-size 1"
        )
    eod = None
    if reset_mask:
        try:
            from megatron.training import get_tokenizer

            eod = get_tokenizer().eod
        except (AssertionError, AttributeError, ImportError, NotImplementedError):
            eod = None
    return MicroBatchDocuments(
        seq_length=seq_length,
        eod_token=eod,
        reset_position_ids=bool(getattr(args, "reset_position_ids", False)),
        required=reset_mask,
    )


def micro_batch_layout(
    args: argparse.Namespace, groups: HexiSeqGroups, provider: BatchLayouts
) -> MicroBatchLayout:
    """The per-micro-batch layout slot of a run with a layout provider (megatron/batch_layout.py)."""
    if (getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1:
        raise HexiSeqError(
            "per-micro-batch layouts do not support pipeline parallelism yet (middle stages "
            "do not load the batch); use --pipeline-model-parallel-size 1"
        )
    sequence_parallel = bool(getattr(args, "sequence_parallel", False))
    return MicroBatchLayout(
        groups,
        provider,
        reset_position_ids=bool(getattr(args, "reset_position_ids", False)),
        tokens_multiple_of=getattr(args, "tensor_model_parallel_size", 1)
        if sequence_parallel
        else 1,
    )


def _stock_layer_spec(
    args: argparse.Namespace,
    config: TransformerConfig,
    vp_stage: int | None,
    stock_builder: Callable[..., GPTModel],
) -> ModuleSpec | TransformerBlockSubmodules:
    """The layer/block spec Megatron-LM's ``gpt_builder`` would choose (core_v0.16.1)."""
    from megatron.core.transformer.spec_utils import import_module

    if args.spec is not None:
        return import_module(args.spec)
    use_te = args.transformer_impl == "transformer_engine"
    if args.num_experts:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        return get_gpt_decoder_block_spec(
            config,
            use_transformer_engine=use_te,
            normalization=args.normalization,
            qk_l2_norm=args.qk_l2_norm,
            vp_stage=vp_stage,
        )
    choose = getattr(sys.modules.get(stock_builder.__module__), "_get_transformer_layer_spec", None)
    if choose is None:
        raise HexiSeqError(
            f"cannot find the layer-spec chooser next to {stock_builder.__module__}."
            f"{stock_builder.__name__}; pass --spec MODULE NAME"
        )
    return choose(use_te, config)


def build_gpt_model(
    args: argparse.Namespace,
    pre_process: bool,
    post_process: bool,
    vp_stage: int | None = None,
    config: TransformerConfig | None = None,
    pg_collection: ProcessGroupCollection | None = None,
    *,
    runtime: HexiSeqRuntime,
    stock_builder: Callable[..., GPTModel],
) -> GPTModel:
    """``gpt_builder`` with HexiSeq: same ``GPTModel`` arguments, spec swapped, layout RoPE."""
    from megatron.core.models.gpt import GPTModel

    for flag, value in (
        ("--use-legacy-models", args.use_legacy_models),
        ("--mtp-num-layers", getattr(args, "mtp_num_layers", None)),
        ("--experimental-attention-variant", getattr(args, "experimental_attention_variant", None)),
        (
            "--heterogeneous-layers-config-path",
            getattr(args, "heterogeneous_layers_config_path", None),
        ),
    ):
        if value:
            raise HexiSeqError(f"{flag} is not supported together with --hexiseq-layout")
    if config is None:
        from megatron.training.arguments import core_transformer_config_from_args
        from megatron.training.yaml_arguments import core_transformer_config_from_yaml

        config = (
            core_transformer_config_from_yaml(args, "language_model")
            if args.yaml_cfg is not None
            else core_transformer_config_from_args(args)
        )
    if args.pipeline_model_parallel_size > 1:
        config.variable_seq_lengths = True  # pipeline P2P shapes follow each rank's token count
    spec = hexiseq_spec(_stock_layer_spec(args, config, vp_stage, stock_builder), runtime)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )
    install_rope(
        model,
        [p for s, e in runtime.segments for p in range(s, e)],
        runtime.documents,
        runtime.batch_layout,
    )
    return model


class HexiSeqModelProvider:
    """Megatron model provider: ``setup`` on the first call, then ``model_provider(builder, ...)``.

    ``model_provider`` / ``gpt_builder`` are Megatron-LM's (``model_provider.py`` /
    ``gpt_builders.py``); ``get_args`` defaults to ``megatron.training.get_args``;
    ``batch_layouts``: a per-micro-batch layout provider, ``training_module``: the module whose
    training-loop seams a job replaces (both passed to ``setup``). Every model chunk it builds for
    a HexiSeq run gets the first rank's weights (``params_check.share_initial_parameters``).
    """

    def __init__(
        self,
        model_provider: Callable,
        gpt_builder: Callable,
        pretrain_module: ModuleType | None,
        *,
        get_args: Callable[[], argparse.Namespace] | None = None,
        batch_layouts: BatchLayouts | None = None,
        training_module: ModuleType | None = None,
    ) -> None:
        self.model_provider = model_provider
        self.training_module = training_module
        self.batch_layouts = batch_layouts
        self.gpt_builder = gpt_builder
        self.pretrain_module = pretrain_module
        self._get_args = get_args
        self._ready = False
        self.runtime: HexiSeqRuntime | None = None

    def __call__(
        self,
        pre_process: bool = True,
        post_process: bool = True,
        vp_stage: int | None = None,
        config: TransformerConfig | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> torch.nn.Module:
        if self._get_args is None:
            from megatron.training import get_args

            self._get_args = get_args
        if not self._ready:
            cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
            self.runtime = setup(
                self._get_args(),
                self.pretrain_module,
                cp_group=cp_group,
                batch_layouts=self.batch_layouts,
                training_module=self.training_module,
            )
            self._ready = True
        builder = self.gpt_builder
        if self.runtime is not None:
            builder = partial(build_gpt_model, runtime=self.runtime, stock_builder=self.gpt_builder)
        model = self.model_provider(
            builder, pre_process, post_process, vp_stage, config=config, pg_collection=pg_collection
        )
        if self.runtime is not None:  # one model on every GPU model (megatron/params_check.py)
            share_initial_parameters(model, megatron_replica_groups(pg_collection))
        return model


def model_provider(
    model_provider_fn: Callable,
    gpt_builder: Callable,
    pretrain_module: ModuleType | None,
    **kwargs: Any,
) -> HexiSeqModelProvider:
    """What ``pretrain_gpt.py`` passes to ``pretrain`` instead of ``partial(model_provider, gpt_builder)``."""
    return HexiSeqModelProvider(model_provider_fn, gpt_builder, pretrain_module, **kwargs)


def set_comm_chunks(model: torch.nn.Module | Sequence[torch.nn.Module], comm_chunks: int) -> int:
    """Set the chunking knob of every ``HexiSeqCoreAttention`` in ``model`` (a module or a list of
    model chunks); returns how many modules changed."""

    changed = 0
    for chunk in [model] if isinstance(model, torch.nn.Module) else model:
        for module in chunk.modules():
            if isinstance(module, HexiSeqCoreAttention) and module.comm_chunks != comm_chunks:
                module.comm_chunks = comm_chunks
                changed += 1
    return changed


class HexiSeqForwardStep:
    """Megatron ``forward_step_func`` wrapper. With ``--hexiseq-overlap-tune`` (and a layout) its
    first call hands over to ``megatron_hooks.OnlineTuningStep``, which owns the online tuner (it
    decides at the end of each training iteration, in Megatron's ``finalize_model_grads_func``)
    and puts the ``comm_chunks`` it chooses into the model; otherwise it calls ``forward_step`` as
    is."""

    def __init__(
        self,
        forward_step: Callable,
        *,
        get_args: Callable[[], argparse.Namespace] | None = None,
    ) -> None:
        self.forward_step = forward_step
        self._get_args = get_args
        self._inner: Callable | None = None

    def _setup(self, args: argparse.Namespace) -> Callable:
        if not megatron_hooks.online_tuning_wanted(args):
            return self.forward_step
        return megatron_hooks.OnlineTuningStep.from_args(
            self.forward_step, args, apply_chunks=set_comm_chunks
        )

    def __call__(
        self,
        data_iterator: object,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if self._inner is None:
            if self._get_args is None:
                from megatron.training import get_args

                self._get_args = get_args
            self._inner = self._setup(self._get_args())
        return self._inner(data_iterator, model, *args, **kwargs)


def forward_step(stock_forward_step: Callable, **kwargs: Any) -> HexiSeqForwardStep:
    """What ``pretrain_gpt.py`` passes to ``pretrain`` instead of ``forward_step``."""
    return HexiSeqForwardStep(stock_forward_step, **kwargs)


def help_with_hexiseq_flags(
    chain: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None = None,
) -> None:
    """With ``-h``/``--help`` on the command line: print Megatron-LM's help *with* the
    ``--hexiseq-*`` flags (and ``chain``'s) and exit 0; otherwise do nothing.

    Call it before ``inprocess_restart.maybe_wrap_for_inprocess_restart``: that function parses the
    command line once without ``extra_args_provider``, so its ``--help`` would list none of ours.
    Both entry points call it first, so it also runs :func:`check_layout_flag` (the patched
    ``pretrain_gpt.py`` has no other hook before ``pretrain``).
    """
    check_layout_flag(sys.argv[1:])
    if not any(a in ("-h", "--help") for a in sys.argv[1:]):
        return
    from megatron.training.arguments import parse_args

    parse_args(extra_args_provider=extra_args_provider(chain))  # argparse prints the help and exits


def run_pretrain(stock: ModuleType) -> None:
    """``pretrain_gpt.py``'s ``__main__`` block (core_v0.16.1) with the HexiSeq hooks."""
    import time

    from megatron.core.enums import ModelType
    from megatron.training import inprocess_restart, pretrain

    try:
        from megatron.training import set_startup_timestamps
    except ImportError:  # older Megatron-LM
        set_startup_timestamps = None
    if set_startup_timestamps is not None:
        start = getattr(stock, "_PROGRAM_START_TIME", time.time())
        set_startup_timestamps(program_start=start, main_entry=time.time())
    stock.train_valid_test_datasets_provider.is_distributed = True
    modelopt = stock.add_modelopt_args if getattr(stock, "has_nvidia_modelopt", False) else None
    help_with_hexiseq_flags(modelopt)
    pretrain_fn, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    pretrain_fn(
        stock.train_valid_test_datasets_provider,
        model_provider(stock.model_provider, stock.gpt_builder, stock),
        ModelType.encoder_or_decoder,
        forward_step(stock.forward_step),
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
        extra_args_provider=extra_args_provider(modelopt),
        store=store,
        get_embedding_ranks=stock.get_embedding_ranks,
    )
