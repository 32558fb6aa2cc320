"""Model spec with Megatron's field names, and the bundled presets.

A ``ModelSpec`` describes a decoder-only GPT in the terms of Megatron's ``TransformerConfig`` /
command line (``--num-layers``, ``--hidden-size``, ``--num-attention-heads``,
``--num-query-groups``, ``--ffn-hidden-size``, ``--kv-channels``, ``--swiglu``,
``--normalization``, ``--add-bias-linear``, ``--seq-length``, ``--micro-batch-size``).
Position embeddings are rotary (no parameters) for every preset; embeddings and the output layer
are untied (``--untie-embeddings-and-output-weights``).

YAML form (``--model-config M.yaml``): the fields below; ``kv_channels`` defaults to
``hidden_size // num_attention_heads``, ``num_query_groups`` to ``num_attention_heads``. A YAML
may start from a preset with ``preset: llama2-7b`` and override fields.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from functools import cached_property
from types import MappingProxyType
from typing import Any

from megatron_hexiseq import spec_schema
from megatron_hexiseq.errors import HexiSeqError, short
from megatron_hexiseq.io import read_yaml


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A GPT-style decoder. Shapes: h = hidden_size, a = num_attention_heads, g = num_query_groups,
    d = kv_channels, f = ffn_hidden_size, V = vocab_size, L = num_layers."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    kv_channels: int
    swiglu: bool
    seq_length: int
    micro_batch_size: int = 1
    normalization: str = "LayerNorm"
    add_bias_linear: bool = True

    def __post_init__(self) -> None:
        # every field's type and range: schema/model.schema.json; here what a schema cannot say
        spec_schema.check(
            self.to_dict(),
            "model",
            lambda path, spec: f"model {short(self.name)}" + "".join(f": {p}" for p in path),
        )
        if self.num_attention_heads % self.num_query_groups:
            raise HexiSeqError(
                f"model {short(self.name)}: num_attention_heads={self.num_attention_heads} is not a "
                f"multiple of num_query_groups={self.num_query_groups}"
            )

    @property
    def heads_per_query_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def layer_parameters(self) -> int:
        """Parameters of one transformer layer (see :attr:`num_parameters`)."""
        h, d, a, g, f = (
            self.hidden_size,
            self.kv_channels,
            self.num_attention_heads,
            self.num_query_groups,
            self.ffn_hidden_size,
        )
        bias = self.add_bias_linear
        qkv_out = (a + 2 * g) * d
        fc1_out = f * (2 if self.swiglu else 1)
        attn = h * qkv_out + a * d * h + (qkv_out + h if bias else 0)
        mlp = h * fc1_out + f * h + (fc1_out + h if bias else 0)
        return attn + mlp + 2 * self._norm_parameters

    @property
    def num_parameters(self) -> int:
        """Exact parameter count of Megatron's GPTModel with untied embeddings and rotary positions.

        ``V*h`` (word embeddings) + ``L * layer`` + final norm + ``V*h`` (output layer, no bias), with
        ``layer = h*(a+2g)*d`` (QKV) ``+ a*d*h`` (projection) ``+ h*f*m + f*h`` (MLP, m = 2 with SwiGLU
        else 1) ``+ 2 norms`` (LayerNorm 2h each: weight and bias; RMSNorm h) ``+ biases`` when
        ``add_bias_linear`` (``(a+2g)*d + h + f*m + h``).
        """
        return (
            2 * self.vocab_size * self.hidden_size
            + self.num_layers * self.layer_parameters
            + self._norm_parameters
        )

    @property
    def _norm_parameters(self) -> int:
        return self.hidden_size * (2 if self.normalization == "LayerNorm" else 1)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _gpt(name: str, layers: int, hidden: int, heads: int, seq: int = 2048) -> ModelSpec:
    # GPT-2 BPE vocabulary 50,257 padded by Megatron to a multiple of 128 -> 50,304.
    return ModelSpec(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=heads,
        ffn_hidden_size=4 * hidden,
        vocab_size=50304,
        kv_channels=hidden // heads,
        swiglu=False,
        seq_length=seq,
    )


def _llama(
    name: str, layers: int, hidden: int, heads: int, groups: int, ffn: int, vocab: int, seq: int
) -> ModelSpec:
    return ModelSpec(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        ffn_hidden_size=ffn,
        vocab_size=vocab,
        kv_channels=hidden // heads,
        swiglu=True,
        seq_length=seq,
        normalization="RMSNorm",
        add_bias_linear=False,
    )


def _preset_specs() -> tuple[ModelSpec, ...]:
    return (
        # GPT-3 family shapes (Brown et al. 2020, Table 2.1: "2.7B", "6.7B", "13B"; the same shapes the
        # Megatron(-DeepSpeed) example scripts list as "GPT-3 2.7B/6.7B/13B"), i.e. the HexiSeq paper's
        # "GPT-style 3B/7B/13B"; ffn = 4h, GELU, LayerNorm, biases.
        _gpt("gpt-3b", 32, 2560, 32),
        _gpt("gpt-7b", 32, 4096, 32),
        _gpt("gpt-13b", 40, 5120, 40),
        # Llama 2 (Touvron et al. 2023; HF meta-llama/Llama-2-7b-hf and -13b-hf config.json).
        _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
        _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
        # Llama 3 (Dubey et al. 2024, Table 3; HF meta-llama/Meta-Llama-3-8B and -70B config.json), GQA 8 groups.
        _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
        _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
        # A 30B-class model: Code Llama 34B (Roziere et al. 2023, "Code Llama: Open Foundation Models
        # for Code", Table 1 / Sec. 2; HF codellama/CodeLlama-34b-hf config.json: 48 layers, hidden
        # 8192, 64 heads, 8 KV heads, intermediate 22016, vocabulary 32000, 16K positions), 33.7B.
        _llama("codellama-34b", 48, 8192, 64, 8, 22016, 32000, 16384),
        # A tiny GPT for the CPU testbed (gloo ranks): 2 layers, 8 heads in 4 query groups (exercises GQA).
        ModelSpec(
            name="gpt-tiny",
            num_layers=2,
            hidden_size=64,
            num_attention_heads=8,
            num_query_groups=4,
            ffn_hidden_size=256,
            vocab_size=256,
            kv_channels=8,
            swiglu=False,
            seq_length=256,
        ),
    )


class _Presets(Mapping[str, ModelSpec]):
    """The bundled presets by name, built (and validated) on first use: validating loads
    ``jsonschema`` (0.1 s CPU), which ``megatron-hexiseq --help`` (~0.1 s CPU) does not need."""

    @cached_property
    def _specs(self) -> Mapping[str, ModelSpec]:
        return MappingProxyType({m.name: m for m in _preset_specs()})

    def __getitem__(self, name: str) -> ModelSpec:
        return self._specs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)


MODEL_PRESETS: Mapping[str, ModelSpec] = _Presets()

_FIELDS = tuple(f.name for f in fields(ModelSpec))


def get_model(
    name: str | None = None,
    *,
    config_path: str | os.PathLike | None = None,
    overrides: Mapping[str, Any] = MappingProxyType({}),
) -> ModelSpec:
    """A preset by ``name`` or a YAML spec at ``config_path`` (exactly one), then ``overrides``.

    ``overrides`` uses the same field names (the CLI passes ``{"seq_length": N}`` for
    ``--seq-length``); ``None`` values are ignored so the CLI can pass unset flags through.
    """
    if (name is None) == (config_path is None):
        raise HexiSeqError(
            "give a model preset name (--model NAME) or a model YAML (--model-config M.yaml), "
            f"not {'both' if name else 'neither'}; presets: {', '.join(MODEL_PRESETS)}"
        )
    if name is not None:
        spec = _preset(name).to_dict()
        where = f"model {short(name)}"
    else:
        assert config_path is not None  # exactly one of name / config_path, checked above
        data = read_yaml(config_path, "model spec")
        where = f"model spec {config_path}"
        spec = _spec_from_yaml(data, where)
    extra = {k: v for k, v in overrides.items() if v is not None}
    unknown = sorted(short(k) for k in extra if k not in _FIELDS)
    if unknown:
        raise HexiSeqError(
            f"{where} overrides: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(_FIELDS)}"
        )
    return _build(spec | extra, where)


def model_from_dict(data: Any, *, source: str = "model spec") -> ModelSpec:
    """Validate a parsed model spec (same rules as a ``--model-config`` YAML)."""
    return _build(_spec_from_yaml(data, source), source)


def _preset(name: str) -> ModelSpec:
    if name not in MODEL_PRESETS:
        raise HexiSeqError(
            f"unknown model preset {short(name)}; known: {', '.join(MODEL_PRESETS)} "
            "(or describe it in a YAML and pass --model-config)"
        )
    return MODEL_PRESETS[name]


def _spec_from_yaml(data: Any, where: str) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        kind = "nothing (empty file?)" if data is None else type(data).__name__
        raise HexiSeqError(f"{where}: expected a mapping of model fields, got {kind}")
    data = dict(data)
    base: dict[str, Any] = {}
    if "preset" in data:
        preset = data.pop("preset")
        if not isinstance(preset, str):
            raise HexiSeqError(f"{where}: preset must be a preset name, got {short(preset)}")
        base = _preset(preset).to_dict()
    spec = base | data
    _check(spec, where)  # before the defaults below compute with the sizes
    spec.setdefault("name", "custom")
    heads, hidden = spec["num_attention_heads"], spec["hidden_size"]
    if "kv_channels" not in spec:
        if hidden % heads:
            raise HexiSeqError(
                f"{where}: hidden_size={hidden} is not a multiple of num_attention_heads={heads}; "
                "set kv_channels explicitly"
            )
        spec["kv_channels"] = hidden // heads
    spec.setdefault("num_query_groups", heads)
    spec.setdefault("swiglu", False)
    return spec


def _build(spec: Mapping[str, Any], where: str) -> ModelSpec:
    _check(spec, where)
    try:
        return ModelSpec(**spec)
    except HexiSeqError as e:
        raise HexiSeqError(f"{where}: {str(e).split(': ', 1)[-1]}") from None


def _check(spec: Mapping[str, Any], where: str) -> None:
    """The spec against schema/model.schema.json: ``{where}: num_layers must be a positive integer, got -2``."""
    spec_schema.check(spec, "model", lambda path, _: where + "".join(f": {p}" for p in path))
