"""Layer (c), GPU only (skipped without CUDA/NCCL): Megatron turns the YAML we write into
``ProcessGroupNCCL.Options`` with our values."""

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
