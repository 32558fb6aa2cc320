"""Layer (c), GPU only (skipped without CUDA/NCCL): Megatron turns the YAML we write into
``ProcessGroupNCCL.Options`` with our values; the online tuner's agreement on a real NCCL default
group (one process): the CPU-tensor error the NCCL-rule simulator reproduces, device tensors on
NCCL, host tensors on the gloo side group."""

import pytest
import torch
import yaml

from megatron_hexiseq.overlap.knobs import NcclGroupOptions, OverlapConfig
from megatron_hexiseq.overlap.nccl import nccl_yaml_text

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not hasattr(torch.distributed, "ProcessGroupNCCL"),
    reason="needs CUDA and NCCL",
)


def test_megatron_builds_nccl_options_from_our_yaml():
    from megatron.core.parallel_state import get_nccl_options

    config = OverlapConfig(
        nccl=(
            NcclGroupOptions(group="dp_cp", min_ctas=2, max_ctas=4, cga_cluster_size=2),
            NcclGroupOptions(group="cp", min_ctas=1, max_ctas=1, is_high_priority_stream=True),
        )
    )
    cfgs = yaml.safe_load(nccl_yaml_text(config))
    dp_cp = get_nccl_options("dp_cp", cfgs)
    assert (dp_cp.config.min_ctas, dp_cp.config.max_ctas, dp_cp.config.cga_cluster_size) == (
        2,
        4,
        2,
    )
    assert dp_cp.is_high_priority_stream is False
    assert get_nccl_options("cp", cfgs).is_high_priority_stream is True


def test_online_tuner_agreement_on_an_nccl_default_group(tmp_path):
    """One process, ``init_process_group("nccl")``: a CPU tensor on the NCCL default group fails
    with the message ``tests/nccl_sim.py`` reproduces; ``search.max_over_ranks`` puts its tensor
    on the CUDA device there; a gloo side group takes host tensors; the tuning step's end of
    iteration runs its agreement on that side group."""
    import types

    import torch.distributed as dist

    from megatron_hexiseq.overlap import megatron_hooks
    from megatron_hexiseq.overlap.knobs import Ladder, SearchSpace
    from megatron_hexiseq.overlap.search import collective_device, max_over_ranks

    if dist.is_initialized():
        pytest.skip("a process group exists already in this process")
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
            dist.all_reduce(torch.ones(1), op=dist.ReduceOp.MAX)
        assert collective_device(dist.group.WORLD).type == "cuda"
        assert max_over_ranks([1.5, 2.0], dist.group.WORLD) == (1.5, 2.0)
        side = dist.new_group(backend="gloo")
        assert collective_device(side).type == "cpu"
        assert max_over_ranks([3.0], side) == (3.0,)
        pushed = []
        step = megatron_hooks.OnlineTuningStep(
            lambda it, m: None,
            space=SearchSpace(ladders=(Ladder(name="a", knob="comm_chunks", values=(1, 2)),)),
            apply_chunks=lambda models, n: pushed.append(n),
            make_group=lambda: dist.new_group(backend="gloo"),
        )
        model = types.SimpleNamespace(
            config=types.SimpleNamespace(finalize_model_grads_func=lambda m, n, **kw: None)
        )
        for _ in range(12):
            step(None, model)
            model.config.finalize_model_grads_func([model], None)
        assert step.tuner is not None and str(dist.get_backend(step.tuner.group)) == "gloo"
        assert pushed[0] == 1 and len(step.tuner.results) == 1
    finally:
        dist.destroy_process_group()
