"""The Megatron-LM patch and its apply script, layer (a): no processes.

Without a Megatron-LM checkout this checks what it can: the patch parses (``git apply
--stat``), touches only ``pretrain_gpt.py``, its added lines are exactly the hook calls (``--help``
with our flags, model provider, forward step, extra args provider) and the imports, and the context lines are those of core_v0.16.1's ``pretrain_gpt.py`` (blob
8eff08d2); the apply script patches a file made of those context lines, says what it did, is
idempotent and refuses a different file. With ``MEGATRON_LM`` set to a core_v0.16.1 checkout
(``scripts/test.sh`` unpacks the snapshot in ``../shared/megatron-lm/`` and sets it), the patch
applies to the real file; tests/test_megatron_lm.py runs the patched script's ``--help``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATCH = ROOT / "patches" / "megatron-lm-core_v0.16.1.patch"
SCRIPT = ROOT / "scripts" / "apply_megatron_patch.sh"
needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")


def _hunks() -> list[list[str]]:
    hunks, cur = [], None
    for line in PATCH.read_text().splitlines():
        if line.startswith("@@"):
            cur = []
            hunks.append(cur)
        elif cur is not None:
            cur.append(line)
    return hunks


def test_patch_touches_only_pretrain_gpt_and_adds_the_hooks():
    text = PATCH.read_text()
    assert re.findall(r"^diff --git a/(\S+) b/(\S+)$", text, re.M) == [
        ("pretrain_gpt.py", "pretrain_gpt.py")
    ]
    assert "index 8eff08d" in text  # the core_v0.16.1 blob of pretrain_gpt.py
    added = [lv[1:].strip() for h in _hunks() for lv in h if lv.startswith("+")]
    removed = [lv[1:].strip() for h in _hunks() for lv in h if lv.startswith("-")]
    assert added == [
        "import sys",
        "from megatron_hexiseq.megatron import plugin as hexiseq  # megatron-hexiseq: --hexiseq-* flags, layout hooks",
        "hexiseq.help_with_hexiseq_flags(add_modelopt_args if has_nvidia_modelopt else None)  # --help lists --hexiseq-*",
        "hexiseq.model_provider(model_provider, gpt_builder, sys.modules[__name__]),",
        "hexiseq.forward_step(forward_step),",
        "extra_args_provider=hexiseq.extra_args_provider(add_modelopt_args if has_nvidia_modelopt else None),",
    ]
    assert removed == [
        "partial(model_provider, gpt_builder),",
        "forward_step,",
        "extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None,",
    ]


def _synthetic_original(tmp: Path) -> Path:
    """A pretrain_gpt.py holding the patch's context and removed lines at the hunk positions."""
    lines: list[str] = []
    for header, hunk in zip(re.findall(r"^@@ -(\d+),", PATCH.read_text(), re.M), _hunks()):
        start = int(header)
        while len(lines) < start - 1:
            lines.append(f"# filler {len(lines)}")
        lines += [lv[1:] for lv in hunk if lv[:1] in (" ", "-")]
    target = tmp / "pretrain_gpt.py"
    target.write_text("\n".join(lines) + "\n")
    return target


@needs_git
def test_patch_parses_and_apply_script_is_idempotent(tmp_path):
    stat = subprocess.run(
        ["git", "apply", "--stat", str(PATCH)], capture_output=True, text=True, check=True
    )
    assert "pretrain_gpt.py" in stat.stdout and "1 file changed" in stat.stdout
    original = _synthetic_original(tmp_path).read_text()
    first = subprocess.run([str(SCRIPT), str(tmp_path)], capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    assert f"patched {tmp_path}/pretrain_gpt.py" in first.stdout and "undo with" in first.stdout
    patched = (tmp_path / "pretrain_gpt.py").read_text()
    assert "hexiseq.model_provider(model_provider, gpt_builder, sys.modules[__name__])" in patched
    second = subprocess.run([str(SCRIPT), str(tmp_path)], capture_output=True, text=True)
    assert second.returncode == 0 and "already applied" in second.stdout
    assert (tmp_path / "pretrain_gpt.py").read_text() == patched
    undo = subprocess.run([str(SCRIPT), "--undo", str(tmp_path)], capture_output=True, text=True)
    assert undo.returncode == 0 and "removed" in undo.stdout, undo.stderr
    assert (tmp_path / "pretrain_gpt.py").read_text() == original
    again = subprocess.run([str(SCRIPT), "--undo", str(tmp_path)], capture_output=True, text=True)
    assert again.returncode == 2 and "nothing to undo" in again.stderr


@needs_git
def test_apply_script_refuses_bad_targets(tmp_path):
    missing = subprocess.run([str(SCRIPT), str(tmp_path)], capture_output=True, text=True)
    assert missing.returncode == 2 and "usage" in missing.stderr
    (tmp_path / "pretrain_gpt.py").write_text("print('some other version')\n")
    other = subprocess.run([str(SCRIPT), str(tmp_path)], capture_output=True, text=True)
    assert (
        other.returncode == 2
        and "does not apply" in other.stderr
        and "core_v0.16.1" in other.stderr
    )


@needs_git
@pytest.mark.skipif(
    not os.environ.get("MEGATRON_LM"), reason="set MEGATRON_LM=<Megatron-LM core_v0.16.1 checkout>"
)
def test_patch_applies_to_real_megatron_lm(tmp_path):
    # a copy outside any git repository: inside one (a snapshot unpacked into this project) git apply
    # would skip the file and pass vacuously
    shutil.copy(Path(os.environ["MEGATRON_LM"]) / "pretrain_gpt.py", tmp_path / "pretrain_gpt.py")
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tmp_path.parent)}
    forward = subprocess.run(
        ["git", "apply", "--check", "-v", str(PATCH)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
    )
    backward = subprocess.run(
        ["git", "apply", "--reverse", "--check", "-v", str(PATCH)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
    )
    assert forward.returncode == 0 or backward.returncode == 0, (
        forward.stderr
    )  # clean or already patched
    assert "Skipped" not in forward.stderr + backward.stderr
    applied = subprocess.run([str(SCRIPT), str(tmp_path)], capture_output=True, text=True)
    assert applied.returncode == 0, applied.stderr
    assert "hexiseq.help_with_hexiseq_flags(" in (tmp_path / "pretrain_gpt.py").read_text()


@needs_git
def test_apply_script_ignores_an_enclosing_repository(tmp_path):
    """A checkout unpacked inside another git repository is still patched (not skipped)."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "sub").mkdir()
    _synthetic_original(tmp_path / "sub")
    res = subprocess.run([str(SCRIPT), str(tmp_path / "sub")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "hexiseq.model_provider(" in (tmp_path / "sub" / "pretrain_gpt.py").read_text()
