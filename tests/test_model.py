"""Model spec and presets.

Layer (a): no processes — presets against published parameter counts, YAML specs with defaults,
overrides, every invalid-spec message.
"""

import pytest

from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.model import MODEL_PRESETS, ModelSpec, get_model, model_from_dict


@pytest.mark.parametrize(
    "name, published",
    [
        ("llama2-7b", 6.74e9),
        ("llama2-13b", 13.02e9),
        ("llama3-8b", 8.03e9),
        ("llama3-70b", 70.55e9),
        ("codellama-34b", 33.74e9),
        ("gpt-3b", 2.7e9),
        ("gpt-7b", 6.7e9),
        ("gpt-13b", 13.0e9),
    ],
)
def test_preset_parameter_counts_match_published(name, published):
    # GPT-3 counts in Brown et al. exclude the (untied here) output layer: allow 3% for the GPT rows.
    tol = (
        0.01
        if name.startswith("llama")
        else 0.03 + 50304 * MODEL_PRESETS[name].hidden_size / published
    )
    assert MODEL_PRESETS[name].num_parameters == pytest.approx(published, rel=tol)


def test_llama2_7b_exact_count_by_hand():
    h, f, V, L = 4096, 11008, 32000, 32
    layer = h * 3 * h + h * h + h * 2 * f + f * h + 2 * h  # QKV, proj, SwiGLU fc1, fc2, 2 RMSNorms
    assert get_model("llama2-7b").num_parameters == 2 * V * h + L * layer + h == 6_738_415_616


def test_tiny_gpt_with_biases_and_layernorm_by_hand():
    m = ModelSpec(
        name="t",
        num_layers=1,
        hidden_size=4,
        num_attention_heads=2,
        num_query_groups=1,
        ffn_hidden_size=8,
        vocab_size=10,
        kv_channels=2,
        swiglu=False,
        seq_length=8,
    )
    qkv = 4 * (2 + 2) * 2 + (2 + 2) * 2  # weight h*(a+2g)*d + bias
    proj = 2 * 2 * 4 + 4
    mlp = 4 * 8 + 8 + 8 * 4 + 4
    norms = 2 * (2 * 4)
    assert m.num_parameters == 2 * 10 * 4 + qkv + proj + mlp + norms + 2 * 4


def test_presets_and_overrides():
    assert {
        "gpt-3b",
        "gpt-7b",
        "gpt-13b",
        "llama2-7b",
        "llama2-13b",
        "llama3-8b",
        "llama3-70b",
        "codellama-34b",
        "gpt-tiny",
    } <= set(MODEL_PRESETS)
    m = get_model("llama3-8b", overrides={"seq_length": 131072, "micro_batch_size": None})
    assert (
        m.seq_length == 131072
        and m.num_query_groups == 8
        and m.kv_channels == 128
        and m.micro_batch_size == 1
    )
    assert get_model("llama3-8b") == MODEL_PRESETS["llama3-8b"]
    with pytest.raises(HexiSeqError, match=r"unknown field\(s\) 'seq_len'"):
        get_model("gpt-tiny", overrides={"seq_len": 4})
    with pytest.raises(HexiSeqError, match=r"seq_length must be a positive integer, got 0"):
        get_model("gpt-tiny", overrides={"seq_length": 0})


def test_yaml_defaults_and_preset_base(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text(
        "name: m\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nffn_hidden_size: 128\n"
        "vocab_size: 100\nseq_length: 512\n"
    )
    m = get_model(config_path=p, overrides={"seq_length": 1024})
    assert (m.kv_channels, m.num_query_groups, m.swiglu, m.seq_length) == (16, 4, False, 1024)
    p.write_text("preset: llama2-7b\nseq_length: 32768\n")
    m = get_model(config_path=p)
    assert m.seq_length == 32768 and m.num_parameters == MODEL_PRESETS["llama2-7b"].num_parameters


BASE = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "ffn_hidden_size": 128,
    "vocab_size": 100,
    "seq_length": 512,
}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_query_groups": 3}, r"num_attention_heads=4 is not a multiple of num_query_groups=3"),
        ({"num_layers": -2}, r"num_layers must be a positive integer, got -2"),
        ({"hidden_size": 64.0}, r"hidden_size must be a positive integer, got 64.0"),
        ({"swiglu": "yes"}, r"swiglu must be true or false"),
        ({"num_heads": 4}, r"unknown field\(s\) 'num_heads'"),
        (
            {"hidden_size": 66},
            r"hidden_size=66 is not a multiple of num_attention_heads=4; set kv_channels",
        ),
        ({"normalization": "BatchNorm"}, r"normalization must be one of LayerNorm, RMSNorm"),
        ({"preset": "llama9"}, r"unknown model preset 'llama9'; known: gpt-3b"),
    ],
)
def test_invalid_model_specs(change, message):
    with pytest.raises(HexiSeqError, match=message) as e:
        model_from_dict(BASE | change, source="model spec m.yaml")
    assert "\n" not in str(e.value)


def test_get_model_argument_errors(tmp_path):
    with pytest.raises(HexiSeqError, match=r"unknown model preset 'gpt-99b'; known: .*llama3-70b"):
        get_model("gpt-99b")
    with pytest.raises(HexiSeqError, match="not neither"):
        get_model()
    with pytest.raises(HexiSeqError, match="not both"):
        get_model("gpt-tiny", config_path="x.yaml")
    with pytest.raises(HexiSeqError, match="model spec is missing 'num_layers'"):
        model_from_dict({k: v for k, v in BASE.items() if k != "num_layers"})
    with pytest.raises(HexiSeqError, match="does not exist"):
        get_model(config_path=tmp_path / "none.yaml")
