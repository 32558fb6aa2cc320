"""megatron-hexiseq: heterogeneous long-context training for Megatron-LM."""

from setuptools import find_packages, setup

# What Megatron-LM's own pretrain_gpt.py (tag core_v0.16.1) imports besides megatron-core, found by
# importing it from the unpacked snapshot in a fresh venv: six and regex (its tokenizers), pydantic
# (megatron.training config), triton (imported at module level by megatron.training.initialize ->
# batch_invariant_kernels; GPU kernels only, nothing on the CPU path calls it; Linux wheels only).
MEGATRON_LM_DEPS = ["six", "regex", "pydantic", "triton; platform_system == 'Linux'"]

# scripts/lint.sh (run by scripts/test.sh): exact versions, because a new ruff or mypy release adds
# rules and inference that turn a passing tree red; the stubs type the library's yaml and
# jsonschema imports.
LINT_DEPS = [
    "ruff==0.17.6",
    "mypy==2.4.1",
    "types-PyYAML==6.0.12.20261122",
    "types-jsonschema==4.26.0.20261006",
]

setup(
    name="megatron-hexiseq",
    version="0.1.0",
    description="Uneven context/head parallelism for Megatron-LM on heterogeneous GPU clusters",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_hexiseq", "megatron_hexiseq.*"]),
    package_data={"megatron_hexiseq": ["schema/*.json", "data/*.yaml"]},
    install_requires=[
        "torch==2.13.0",
        "megatron-core==0.16.1",
        "ortools>=9.10",
        "numpy",
        "pyyaml",
        "jsonschema",
        "rich",
        "matplotlib",
        "python-hostlist",  # SLURM host lists (import hostlist), sized before they are expanded
        "psutil",  # megatron.core.dist_checkpointing's torch_dist save measures its process memory with it
    ],
    extras_require={
        "gpu": ["transformer-engine", "flash-attn", "nvidia-ml-py"],
        "megatron-lm": MEGATRON_LM_DEPS,
        "test": ["pytest", "pytest-xdist==3.6.1", *MEGATRON_LM_DEPS, *LINT_DEPS],
    },
    entry_points={"console_scripts": ["megatron-hexiseq=megatron_hexiseq.cli:main"]},
)
