"""Layer (a), no processes: knobs, NCCL YAML, results file, Megatron args hooks, drift monitor,
online tuner (single process), the CPU bench's model scaling, and the ``tune`` command's
non-tuning paths (user errors: one line, exit 2)."""

import argparse
import dataclasses
import json
import types

import pytest
import yaml

from megatron_hexiseq.cli import main
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.model import get_model
from megatron_hexiseq.overlap import megatron_hooks
from megatron_hexiseq.overlap.knobs import (
    Ladder,
    NcclGroupOptions,
    OverlapConfig,
    SearchSpace,
    ddp_ladder,
)
from megatron_hexiseq.overlap.monitor import DriftMonitor, MonitorConfig
from megatron_hexiseq.overlap.nccl import nccl_yaml_dict, nccl_yaml_text, write_nccl_yaml
from megatron_hexiseq.overlap.online import OnlineTuner
from megatron_hexiseq.overlap.results import TuneResult, load_result, save_result
from megatron_hexiseq.overlap.search import Trial, priority_search
from megatron_hexiseq.testbed.overlap_bench import (
    DEFAULT_MAX_PARAMS,
    MAX_ATTENTION_BYTES,
    BenchModel,
    attention_bytes,
    scale_for_cpu,
)

GPU_CONFIG = OverlapConfig(
    overlap_grad_reduce=True,
    bucket_size=20_000_000,
    comm_chunks=4,
    nccl=(
        NcclGroupOptions(group="cp", min_ctas=2, max_ctas=2, is_high_priority_stream=True),
        NcclGroupOptions(group="dp_cp", min_ctas=4, max_ctas=8, cga_cluster_size=2),
    ),
)


# ----------------------------------------------------------------------------- knobs


def test_ddp_ladder_and_search_space():
    ladder = ddp_ladder(1_000_000, min_bucket_params=100_000)
    assert ladder.values == ((False, None), (True, 500_000), (True, 250_000), (True, 125_000))
    space = SearchSpace(
        ladders=(
            ladder,
            Ladder(name="attn", knob="comm_chunks", values=(1, 2, 4)),
            Ladder(name="nccl_dp_cp", knob="nccl_ctas:dp_cp", values=(2, 8)),
        )
    )
    assert space.num_levels == (4, 3, 2) and len(list(space.grid())) == 24
    c = space.config_at((2, 1, 1))
    assert (c.overlap_grad_reduce, c.bucket_size, c.comm_chunks) == (True, 250_000, 2)
    assert c.nccl == (NcclGroupOptions(group="dp_cp", min_ctas=8, max_ctas=8),)
    assert space.config_at((0, 0, 0)).overlap_grad_reduce is False


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(group="nope"), "not a Megatron process group"),
        (dict(group="dp", min_ctas=0), "outside 1..64"),
        (dict(group="dp", min_ctas=8, max_ctas=4), "min_ctas=8 > max_ctas=4"),
    ],
)
def test_nccl_options_validation(kwargs, message):
    with pytest.raises(HexiSeqError, match=message):
        NcclGroupOptions(**kwargs)


def test_config_validation():
    with pytest.raises(HexiSeqError, match="comm_chunks"):
        OverlapConfig(comm_chunks=0)
    with pytest.raises(HexiSeqError, match="unknown overlap knob"):
        OverlapConfig.from_dict({"bucket": 3})


# ----------------------------------------------------------------------------- NCCL YAML


def test_nccl_yaml_for_a_result(tmp_path):
    assert nccl_yaml_dict(GPU_CONFIG) == {
        "cp": {"min_ctas": 2, "max_ctas": 2, "is_high_priority_stream": True},
        "dp_cp": {
            "min_ctas": 4,
            "max_ctas": 8,
            "cga_cluster_size": 2,
            "is_high_priority_stream": False,
        },
    }
    path = tmp_path / "nccl.yaml"
    assert write_nccl_yaml(GPU_CONFIG, path)
    assert yaml.safe_load(path.read_text()) == nccl_yaml_dict(GPU_CONFIG)  # Megatron reads it so
    assert yaml.safe_load(nccl_yaml_text(GPU_CONFIG))["cp"]["max_ctas"] == 2
    assert GPU_CONFIG.high_priority_stream_groups == ("cp",)
    assert not write_nccl_yaml(OverlapConfig(), tmp_path / "none.yaml")
    assert not (tmp_path / "none.yaml").exists()


def test_nccl_yaml_keys_are_the_ones_megatron_reads():
    import inspect

    from megatron.core import parallel_state

    source = inspect.getsource(parallel_state.get_nccl_options)
    for entry in nccl_yaml_dict(GPU_CONFIG).values():
        for key in entry:
            assert f'"{key}"' in source, key


# ----------------------------------------------------------------------------- results


def _result():
    space = SearchSpace(ladders=(ddp_ladder(1_000_000, min_bucket_params=250_000),))
    search = priority_search(
        space.num_levels,
        lambda lv: [Trial(10, (30,), 40), Trial(12, (20,), 32), Trial(14, (25,), 35)][lv[0]],
    )
    return TuneResult.from_search(
        space, search, default_z_us=40.0, tuned_z_us=32.0, setup={"mode": "test"}
    )


def test_results_round_trip(tmp_path):
    r = _result()
    assert r.levels == (1,) and r.num_trials == 3 and r.config.bucket_size == 500_000
    save_result(r, tmp_path / "r.json")
    back = load_result(tmp_path / "r.json")
    assert back == r
    d = json.loads((tmp_path / "r.json").read_text())
    assert d["num_trials"] == 3 and d["trials"][1]["config"]["bucket_size"] == 500_000
    gpu = TuneResult(config=GPU_CONFIG)
    save_result(gpu, tmp_path / "g.json")
    assert load_result(tmp_path / "g.json").config == GPU_CONFIG


def test_results_errors(tmp_path):
    (tmp_path / "bad.json").write_text('{"config": {}, "format_version": 99}')
    with pytest.raises(HexiSeqError, match="format_version 99"):
        load_result(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text("[1, 2]")
    with pytest.raises(HexiSeqError, match="not an overlap tuning result"):
        load_result(tmp_path / "other.json")


# ----------------------------------------------------------------------------- Megatron args


def _megatron_args(**kw):
    base = dict(
        overlap_grad_reduce=False,
        ddp_bucket_size=None,
        nccl_communicator_config_path=None,
        high_priority_stream_groups=None,
        hexiseq_comm_chunks=1,
        hexiseq_overlap_tune=False,
        hexiseq_overlap_config=None,
        hexiseq_layout=None,
        save=None,
    )
    base.update(kw)
    return argparse.Namespace(**base)


def test_configure_from_args_applies_a_saved_result(tmp_path):
    save_result(TuneResult(config=GPU_CONFIG), tmp_path / "r.json")
    user_yaml = tmp_path / "user.yaml"
    user_yaml.write_text(yaml.safe_dump({"tp": {"max_ctas": 16}, "cp": {"max_ctas": 32}}))
    args = _megatron_args(
        hexiseq_overlap_config=str(tmp_path / "r.json"),
        nccl_communicator_config_path=str(user_yaml),
        high_priority_stream_groups=["dp_cp"],
    )
    megatron_hooks.configure_from_args(args)
    assert args.overlap_grad_reduce is True and args.ddp_bucket_size == 20_000_000
    assert args.hexiseq_comm_chunks == 4 and args.high_priority_stream_groups == ["dp_cp", "cp"]
    assert args.nccl_communicator_config_path == str(tmp_path / "r.json") + ".nccl.yaml"
    written = yaml.safe_load(open(args.nccl_communicator_config_path))
    assert written["tp"] == {"max_ctas": 16}  # user's group kept
    assert written["cp"] == nccl_yaml_dict(GPU_CONFIG)["cp"]  # ours wins


def test_configure_from_args_warns_when_groups_already_exist(tmp_path, monkeypatch):
    from megatron.core import parallel_state

    save_result(TuneResult(config=GPU_CONFIG), tmp_path / "r.json")
    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: True)
    with pytest.warns(UserWarning, match="--high-priority-stream-groups cp"):
        megatron_hooks.configure_from_args(
            _megatron_args(hexiseq_overlap_config=str(tmp_path / "r.json"))
        )


def test_configure_from_args_cpu_result_and_errors(tmp_path):
    save_result(_result(), tmp_path / "r.json")
    args = _megatron_args(hexiseq_overlap_config=str(tmp_path / "r.json"), ddp_num_buckets=8)
    with pytest.warns(UserWarning, match="ignoring --ddp-num-buckets 8"):
        megatron_hooks.configure_from_args(args)
    assert (
        args.overlap_grad_reduce is True
        and args.ddp_bucket_size == 500_000
        and args.ddp_num_buckets is None
    )
    assert args.nccl_communicator_config_path is None  # no NCCL options: no YAML
    with pytest.raises(HexiSeqError, match="either"):
        megatron_hooks.configure_from_args(
            _megatron_args(hexiseq_overlap_config="x", hexiseq_overlap_tune=True)
        )
    with pytest.raises(HexiSeqError, match="does not exist"):
        megatron_hooks.configure_from_args(
            _megatron_args(hexiseq_overlap_config=str(tmp_path / "missing.json"))
        )
    with pytest.warns(UserWarning, match="no overlap\\s+knob"):
        args = _megatron_args(hexiseq_overlap_tune=True)
        megatron_hooks.configure_from_args(args)
    assert not megatron_hooks.online_tuning_wanted(args)
    assert megatron_hooks.online_tuning_wanted(
        _megatron_args(hexiseq_overlap_tune=True, hexiseq_layout="l.json")
    )
    assert vars(args) == vars(
        _megatron_args(hexiseq_overlap_tune=True)
    )  # nothing written on Megatron's args


# ----------------------------------------------------------------------------- drift monitor


def _feed(monitor, step_times, exposed=0.0):
    return [i for i, s in enumerate(step_times) if monitor.observe(s, exposed * s)]


CFG = MonitorConfig(window=5, threshold=0.10, rearm=0.05, patience=2, cooldown=1)


def test_monitor_ignores_noise_below_threshold():
    m = DriftMonitor(CFG)
    noise = [1.0, 1.08, 0.93, 1.05, 0.97] * 40
    assert _feed(m, noise) == [] and m.triggers == 0


def test_monitor_triggers_once_on_sustained_drift_then_rebaselines():
    m = DriftMonitor(CFG)
    fired = _feed(m, [1.0] * 10 + [1.25] * 20)  # baseline window 0; drifted windows 2, 3
    assert fired == [19]  # the last step of the 2nd drifted window
    assert _feed(m, [1.25] * 20) == []  # tuning: silent
    m.tuned()
    assert _feed(m, [1.25] * 100) == [] and m.triggers == 1  # new normal: no oscillation
    assert m.baseline.step_s == 1.25


def test_monitor_hysteresis_band():
    m = DriftMonitor(
        CFG
    )  # windows: baseline, +12%, +7% (inside the band: count kept), +12% -> fire
    assert _feed(m, [1.0] * 5 + [1.12] * 5 + [1.07] * 5 + [1.12] * 5) == [19]
    m = DriftMonitor(CFG)  # +3% resets the count: never two drifted windows in a row
    assert _feed(m, [1.0] * 5 + ([1.12] * 5 + [1.03] * 5) * 6) == []
    m = DriftMonitor(CFG)  # alternating levels 15% apart never trigger
    assert _feed(m, [1.0] * 5 + ([1.15] * 5 + [1.0] * 5) * 6) == []


def test_monitor_watches_the_exposed_share():
    m = DriftMonitor(CFG)
    fired = [i for i, e in enumerate([0.05] * 5 + [0.30] * 10) if m.observe(1.0, e)]
    assert fired == [14]
    with pytest.raises(HexiSeqError, match="rearm < threshold"):
        MonitorConfig(threshold=0.05, rearm=0.1)


# ----------------------------------------------------------------------------- online tuner


def test_online_tuner_trial_sequence_save_and_retune():
    space = SearchSpace(ladders=(Ladder(name="attn", knob="comm_chunks", values=(1, 2, 4, 8)),))
    exposed_by_chunks = {1: 0.040, 2: 0.020, 4: 0.010, 8: 0.012}
    applied, saved = [], []
    tuner = OnlineTuner(
        space,
        lambda c: applied.append(c.comm_chunks),
        on_done=saved.append,
        settle_steps=1,
        steps_per_trial=3,
        gallop=False,
        monitor=DriftMonitor(MonitorConfig(window=4, patience=1, cooldown=0)),
    )
    slow = 0.0
    for _ in range(60):
        if not tuner.tuning and saved and len(saved) == 1 and tuner.monitor.baseline is not None:
            slow = 0.05  # the environment changes after tuning: steps get 50 ms slower
        chunks = applied[-1]
        e = exposed_by_chunks[chunks]
        compute = 0.100 + 0.002 * chunks
        tuner.on_step(compute + e + slow + 0.02, compute, [e])
    first = saved[0]
    assert [s.levels for s in first.trials] == [(0,), (1,), (2,), (3,)]
    assert [s.decision for s in first.trials][-1] == "reject-slower"
    assert first.config.comm_chunks == 4 and applied[:5] == [1, 2, 4, 8, 4]
    assert (
        tuner.monitor.triggers == 1 and len(saved) == 2
    )  # drift -> re-tuned from minimal resources
    assert saved[1].config.comm_chunks == 4


# ----------------------------------------------------------------------------- CLI


def test_tune_command_from_result_writes_nccl_yaml(tmp_path, capsys):
    save_result(TuneResult(config=GPU_CONFIG), tmp_path / "r.json")
    rc = main(
        ["tune", "--from-result", str(tmp_path / "r.json"), "--nccl-yaml", str(tmp_path / "n.yaml")]
    )
    assert rc == 0 and yaml.safe_load((tmp_path / "n.yaml").read_text()) == nccl_yaml_dict(
        GPU_CONFIG
    )
    assert "chosen: overlap b=20000000 chunks=4" in capsys.readouterr().out
    assert main(["tune", "--from-result", str(tmp_path / "missing.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["tune", "--world-size", "1", "--model", "gpt-tiny"]) == 2
    assert "--world-size must be in [2, 64]" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["tune"], "give a model preset name (--model NAME) or a model YAML"),
        (["tune", "--model", "gpt-huge"], "unknown model preset 'gpt-huge'"),
        (["tune", "--model-config", "missing.yaml"], "does not exist"),
        (
            ["tune", "--model", "gpt-tiny", "--max-params", "0"],
            "--max-params must be in [1, 256000000]",
        ),
        (["tune", "--model", "llama3-70b", "--max-params", "1000000"], "raise --max-params"),
        (["tune", "--model", "llama3-70b", "--seq-length", "4096"], "use at most 224 tokens"),
        (["tune", "--model", "gpt-tiny", "--from-result", "r.json"], "drop --model/--model-config"),
    ],
)
def test_tune_command_user_errors(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save_result(TuneResult(config=GPU_CONFIG), tmp_path / "r.json")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


# ----------------------------------------------------------------------------- CPU bench model


def test_scale_for_cpu_keeps_layers_and_heads_and_shrinks_widths():
    tiny = get_model("gpt-tiny")  # 124,544 parameters, kv_channels 8
    assert scale_for_cpu(
        tiny, max_params=tiny.num_parameters, seq_length=16
    ) == dataclasses.replace(tiny, seq_length=16)
    # one parameter less: the next even kv_channels, 6 = 0.75 x 8; every width x 0.75
    small = scale_for_cpu(tiny, max_params=tiny.num_parameters - 1, seq_length=1024)
    assert (small.kv_channels, small.hidden_size, small.ffn_hidden_size, small.vocab_size) == (
        6,
        48,
        192,
        192,
    )
    assert (
        small.num_layers,
        small.num_attention_heads,
        small.num_query_groups,
        small.seq_length,
    ) == (2, 8, 4, 256)
    assert small.name == "gpt-tiny@cpu" and small.num_parameters <= tiny.num_parameters - 1
    # llama3-70b at the default budget: kv_channels 128 -> 2 (the largest even one that fits)
    big = get_model("llama3-70b")
    scaled = scale_for_cpu(big)
    assert (scaled.kv_channels, scaled.hidden_size, scaled.num_layers, scaled.num_query_groups) == (
        2,
        128,
        80,
        8,
    )
    assert (
        scaled.num_parameters
        <= DEFAULT_MAX_PARAMS
        < scale_for_cpu(big, max_params=10**9).num_parameters
    )
    assert scale_for_cpu(big, max_params=10**9).kv_channels > 2


def test_scale_for_cpu_bounds_the_reference_attention_memory():
    gpt7b = get_model(
        "gpt-7b"
    )  # 32 layers, 32 heads: (32 + 3) * 32 * S^2 * 4 bytes <= 1 GiB -> S <= 489
    assert attention_bytes(gpt7b, 489) <= MAX_ATTENTION_BYTES < attention_bytes(gpt7b, 490)
    assert scale_for_cpu(gpt7b, seq_length=489).seq_length == 489
    with pytest.raises(HexiSeqError, match="use at most 489 tokens"):
        scale_for_cpu(gpt7b, seq_length=490)


def test_bench_bucket_is_the_target_bucket_times_the_parameter_ratio():
    models = BenchModel.for_target(get_model("gpt-7b"))
    ratio = models.bench.num_parameters / models.target.num_parameters
    assert models.param_ratio == ratio
    assert models.bench_bucket(OverlapConfig(), dp_size=2) is None  # no overlap: one bucket
    assert models.bench_bucket(
        OverlapConfig(overlap_grad_reduce=True, bucket_size=10**8), dp_size=2
    ) == round(1e8 * ratio)
    # Megatron's default with overlap: max(40M, 1M x dp) parameters of gpt-7b
    assert models.bench_bucket(OverlapConfig(overlap_grad_reduce=True), dp_size=2) == round(
        4e7 * ratio
    )
    assert models.bench_bucket(OverlapConfig(overlap_grad_reduce=True), dp_size=64) == round(
        6.4e7 * ratio
    )


def test_online_tuning_step_decides_at_the_end_of_each_iteration():
    clock = iter(float(t) for t in range(0, 1000, 1))
    seen, pushed, saved, finalized = [], [], [], []
    config = types.SimpleNamespace(finalize_model_grads_func=None)
    model = types.SimpleNamespace(config=config)  # a model chunk as get_model_config finds it
    step = megatron_hooks.OnlineTuningStep(
        lambda it, m: seen.append(it) or "out",
        space=SearchSpace(ladders=(Ladder(name="attn", knob="comm_chunks", values=(1, 2)),)),
        apply_chunks=lambda models, n: pushed.append((models, n)),
        on_done=saved.append,
        clock=lambda: next(clock),
    )  # no process group: make_group() gives None, a single process
    assert step(-1, model) == "out" and not step.installed  # before train(): nothing to hook yet
    config.finalize_model_grads_func = lambda models, n, **kw: finalized.append(n) or "reduced"
    for i in range(11):  # 2 micro-batches per iteration, then Megatron's finalize_model_grads
        assert step(2 * i, model) == "out" and step(2 * i + 1, model) == "out"
        assert config.finalize_model_grads_func(["chunk"], i, pg_collection=None) == "reduced"
    assert seen == list(range(-1, 22)) and finalized == list(range(11))  # Megatron's still runs
    assert step.installed and step.tuner is not None and step.tuner.group is None
    # the clock is read once per iteration end (1 tick per iteration whatever the configuration):
    # the tuner starts at the end of iteration 1 (1 chunk); each trial is 1 settling + 4 timed
    # iterations; chunks=2 (end of iteration 6) is accepted within the 5% noise tolerance, the
    # ladder ends, and the tie goes to fewer resources -> back to 1 at the end of iteration 11
    assert pushed == [(["chunk"], 1), (["chunk"], 2), (["chunk"], 1)] and not step.tuner.tuning
    assert [s.decision for s in saved[0].trials] == ["start", "accept"]
    assert saved[0].config.comm_chunks == 1
    assert [s.trial.z_us for s in saved[0].trials] == [1e6, 1e6]
    assert step.comm_chunks == step.model_chunks == 1
    hook = config.finalize_model_grads_func
    step._install(model)  # installing again does not wrap the wrapper
    assert config.finalize_model_grads_func is hook


def test_online_tuning_step_from_args_saves_on_rank_zero(tmp_path):
    args = _megatron_args(hexiseq_overlap_tune=True, hexiseq_layout="l.json", save=str(tmp_path))
    step = megatron_hooks.OnlineTuningStep.from_args(
        lambda it, m: None, args, apply_chunks=lambda m, n: None
    )
    assert step.space.ladders[0].values == megatron_hooks.COMM_CHUNKS_LADDER
    assert step.make_group is megatron_hooks.side_group  # gloo agreement, whatever the backend
    args.enable_gloo_process_groups = False  # --disable-gloo-process-groups: the default group
    no_gloo = megatron_hooks.OnlineTuningStep.from_args(
        lambda it, m: None, args, apply_chunks=lambda m, n: None
    )
    assert no_gloo.make_group is megatron_hooks.default_group
    assert megatron_hooks.default_group() is megatron_hooks.side_group() is None  # one process
    assert step.on_done is not None
    step.on_done(TuneResult(config=OverlapConfig(comm_chunks=4)))
    assert load_result(tmp_path / "hexiseq_overlap.json").config.comm_chunks == 4
