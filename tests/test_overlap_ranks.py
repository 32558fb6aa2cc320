"""Layer (b), two gloo ranks via ``run_ranks`` (one spawn for every case): ranks agree on every
trial of the search (offline and online) even when their measurements differ; the CPU testbed's
Megatron DDP gradients match an unsharded single-process reference for every DDP knob setting;
the offline tuner runs end to end on the testbed."""
import torch
import torch.distributed as dist

from megatron_hexiseq.overlap import offline
from megatron_hexiseq.overlap import testbed as tbm
from megatron_hexiseq.overlap.knobs import Ladder, OverlapConfig, SearchSpace
from megatron_hexiseq.overlap.monitor import DriftMonitor, MonitorConfig
from megatron_hexiseq.overlap.online import OnlineTuner
from megatron_hexiseq.overlap.search import Trial, distributed_priority_search, priority_search
from megatron_hexiseq.testbed.spawn import run_ranks

X_TABLE = [100.0, 80.0, 70.0, 72.0, 50.0]


def synthetic(rank, levels):
    """Rank 1 sees level 2 as no faster (alone it would stop at level 1); rank 0 sees the table."""
    x = X_TABLE[levels[0]] + (15.0 if rank == 1 and levels[0] == 2 else 0.0)
    return Trial(y_us=10.0 + levels[0], x_us=(x,), z_us=max(10.0 + levels[0], x))


TINY = tbm.TestbedConfig(model=tbm.TestbedModel(num_layers=2, hidden_size=64, num_attention_heads=4,
                                                vocab_size=128, seq_length=16),
                         warmup_steps=0, measure_steps=1)


def _worker(rank, world_size):
    group = dist.new_group([0, 1], backend="gloo")
    out = {}
    # 1. offline search: decisions from rank 0 on trials maximised over ranks
    calls = []

    def measure(levels):
        calls.append(levels)
        return synthetic(rank, levels)

    out["search"] = distributed_priority_search((5,), measure, group=group)
    out["calls"] = calls
    # 2. online tuner: rank-dependent step times, same applied configurations everywhere
    space = SearchSpace(ladders=(Ladder(name="attn", knob="comm_chunks", values=(1, 2, 4, 8)),))
    applied = []
    tuner = OnlineTuner(space, lambda c: applied.append(c.comm_chunks), settle_steps=0, steps_per_trial=2,
                        gallop=False, group="world", monitor=DriftMonitor(MonitorConfig(window=2)))
    for _ in range(12):
        c = applied[-1]
        e = {1: 0.04, 2: 0.02, 4: 0.01 + 0.02 * rank, 8: 0.03}[c]  # rank 1 finds 4 chunks slow
        tuner.on_step(0.1 + e, 0.1, [e])
    out["applied"] = applied
    out["online"] = tuner.results[0]
    # 3. testbed: reduced DDP gradients vs the mean of per-rank gradients of a plain model
    tb = tbm.Testbed(TINY, group)
    _, plain = tb.build_model()
    ref = {}
    for r in range(world_size):
        plain.zero_grad()
        tb.loss(plain, tb.rank_tokens(r)).backward()
        for n, p in plain.named_parameters():
            ref[n] = ref.get(n, 0) + p.grad / world_size
    n_params = tb.count_params()
    grads, buckets = {}, {}
    for cfg in (OverlapConfig(), OverlapConfig(overlap_grad_reduce=True, bucket_size=n_params // 8)):
        grads[cfg.label()] = tb.reduced_grads(cfg)
        buckets[cfg.label()] = tb.measure(cfg).num_buckets
    out["grads_ok"] = {}
    for label, g in grads.items():
        for n in ref:
            torch.testing.assert_close(g[n], ref[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{label} {n}: {m}")
        out["grads_ok"][label] = True
    out["buckets"] = buckets
    # 4. offline tuner end to end on the tiny testbed
    out["tuned"] = offline._tune_rank(rank, world_size, offline.OfflineTuneSpec(testbed=TINY, min_bucket_params=2_000))
    return out


def test_two_ranks_agree_and_testbed_matches_reference():
    r0, r1 = run_ranks(_worker, 2)
    # search: identical on both ranks, equal to one process searching the max-combined cost
    assert r0["search"] == r1["search"]
    assert r0["calls"] == r1["calls"] == [(0,), (1,), (2,)]
    expected = priority_search((5,), lambda l: Trial(*(max(a, b) if not isinstance(a, tuple) else
                                                       tuple(map(max, a, b)) for a, b in
                                                       zip(_fields(synthetic(0, l)), _fields(synthetic(1, l))))))
    assert r0["search"] == expected and r0["search"].levels == (1,)
    # online: rank 1 rejects 4 chunks for both ranks
    assert r0["applied"] == r1["applied"] == [1, 2, 4, 2]
    assert r0["online"] == r1["online"] and r0["online"].config.comm_chunks == 2
    # testbed
    assert r0["grads_ok"] == r1["grads_ok"] and len(r0["grads_ok"]) == 2
    labels = list(r0["buckets"])
    assert r0["buckets"][labels[0]] == 1 and r0["buckets"][labels[1]] > 1
    assert r0["tuned"] == r1["tuned"] and r0["tuned"].num_trials >= 2
    assert r0["tuned"].trials[0].levels == (0,) and r0["tuned"].default_z_us > 0


def _fields(t):
    return t.y_us, t.x_us, t.z_us
