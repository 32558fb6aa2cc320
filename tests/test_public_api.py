"""The package's public API (layer a: no processes besides one plain interpreter).

``megatron_hexiseq.__all__`` names resolve to the objects of their defining modules, and
``import megatron_hexiseq`` loads none of the heavy dependencies (torch, OR-Tools, megatron.core).
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import megatron_hexiseq


@pytest.mark.parametrize("name", sorted(megatron_hexiseq._EXPORTS))
def test_export_is_the_defining_modules_object(name: str) -> None:
    module = importlib.import_module(megatron_hexiseq._EXPORTS[name])
    assert getattr(megatron_hexiseq, name) is getattr(module, name)
    assert name in megatron_hexiseq.__all__


def test_all_is_the_exports() -> None:
    assert set(megatron_hexiseq.__all__) == {
        "HexiSeqError",
        "__version__",
        *megatron_hexiseq._EXPORTS,
    }


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_thing"):
        megatron_hexiseq.no_such_thing  # noqa: B018


def test_importing_the_package_is_cheap() -> None:
    code = (
        "import sys, megatron_hexiseq; "
        "print(','.join(m for m in ('torch', 'ortools', 'megatron.core') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_the_docstring_example_plans() -> None:
    from megatron_hexiseq import AUTO_MODES, TrainOptions, estimate, get_model, load_cluster, plan
    from megatron_hexiseq.run_config import options_from_record

    cluster = load_cluster("examples/clusters/mixed-h100-a100.yaml")
    model = get_model("gpt-7b", overrides={"seq_length": 131072})
    layout = plan(cluster, model, model.seq_length, TrainOptions(), modes=AUTO_MODES)
    options = options_from_record(layout.meta["options"])
    # predicted is rounded to 6 significant digits in the file
    assert layout.predicted["iteration_time_s"] == pytest.approx(
        estimate(layout, cluster, model, options).iteration_time_s, rel=1e-5
    )
