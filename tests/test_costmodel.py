"""Cost model: formulas, link model, K/V exchange rounds, whole-iteration estimates.

Layer (a): no processes. Exact values on tiny hand-computed cases, brute-force cross-checks of the
closed forms and of the vectorised exchange, and every mismatch message.
"""

import itertools
import random

import numpy as np
import pytest

from megatron_hexiseq.cluster import cluster_from_dict
from megatron_hexiseq.costmodel import (
    activation_bytes_per_token,
    alltoall_time_s,
    attention_backward_bytes_per_group_token,
    attention_bytes_per_group_token,
    attention_flops_per_pair_head,
    causal_pairs,
    estimate,
    fan_units,
    kv_exchange_forward,
    layer_activation_bytes_per_token,
    linear_flops_per_token,
    pipelined_exposed_s,
    port_times_s,
    static_memory_bytes,
)
from megatron_hexiseq.costmodel.exchange import pairs_vec
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout, make_layout, zigzag_segments
from megatron_hexiseq.model import MODEL_PRESETS, ModelSpec
from megatron_hexiseq.run_config import (
    TrainOptions,
    check_options_record,
    megatron_flags,
    modes_to_try,
    options_from_record,
    options_record,
)

# tiny model: h=8, a=g=2, d=4, f=16, V=16, L=1, GELU, LayerNorm with biases
TINY = ModelSpec(
    name="tiny",
    num_layers=1,
    hidden_size=8,
    num_attention_heads=2,
    num_query_groups=2,
    ffn_hidden_size=16,
    vocab_size=16,
    kv_channels=4,
    swiglu=False,
    seq_length=8,
)
T_GPU = {"T": {"bf16_tflops": 1, "memory_gib": 1, "nvlink_GBps": 10, "efficiency": 1.0}}


def _brute_pairs(qs, ks):
    qpos = [p for s, e in qs for p in range(s, e)]
    kpos = [p for s, e in ks for p in range(s, e)]
    return sum(1 for q in qpos for k in kpos if k <= q)


def _random_segments(rng, seq, parts):
    cuts = sorted(rng.sample(range(1, seq), parts - 1))
    bounds = [0, *cuts, seq]
    return [(bounds[i], bounds[i + 1]) for i in range(parts)]


# ---- formulas ----------------------------------------------------------------------------------
def test_causal_pairs_hand_values():
    assert causal_pairs([(0, 4)], [(0, 4)]) == 10
    assert causal_pairs([(4, 8)], [(0, 4)]) == 16  # all keys before all queries
    assert causal_pairs([(0, 4)], [(4, 8)]) == 0  # all keys after
    zz = zigzag_segments(8, 2)  # [[0,2),[6,8)] and [[2,4),[4,6)]
    assert [causal_pairs(s, [(0, 8)]) for s in zz] == [18, 18]  # zig-zag balances the causal work
    assert causal_pairs(zz[0], zz[0]) == 10 and causal_pairs(zz[0], zz[1]) == 8
    assert causal_pairs(zz[1], zz[0]) == 8 and causal_pairs([], [(0, 8)]) == 0


def test_causal_pairs_and_vectorised_form_match_brute_force():
    rng = random.Random(0)
    qs_all, ks_all, want = [], [], []
    for _ in range(200):
        seq = rng.randint(2, 40)
        segs = _random_segments(rng, seq, rng.randint(1, min(6, seq)))
        rng.shuffle(segs)
        q, k = sorted(segs[: len(segs) // 2 + 1]), sorted(segs[len(segs) // 2 + 1 :] or segs[:1])
        assert causal_pairs(q, k) == _brute_pairs(q, k)
        qs_all.append(q)
        ks_all.append(k)
        want.append(_brute_pairs(q, k))
    w = max(max(len(q), len(k)) for q, k in zip(qs_all, ks_all))
    arr = np.zeros((4, len(want), w), dtype=np.int64)
    for i, (q, k) in enumerate(zip(qs_all, ks_all)):
        for j, (s, e) in enumerate(q):
            arr[0, i, j], arr[1, i, j] = s, e
        for j, (s, e) in enumerate(k):
            arr[2, i, j], arr[3, i, j] = s, e
    assert pairs_vec(*arr).tolist() == want


def test_flop_formulas():
    # per layer MACs: QKV 8*6*4 + proj 2*4*8 + fc1 8*16 + fc2 16*8 = 512; logits 8*16 = 128
    assert linear_flops_per_token(TINY) == 3 * 2 * (512 + 128) == 3840
    assert attention_flops_per_pair_head(TINY) == 12 * 4 * 1
    # Narayanan et al. 2021: 72*L*h^2 + 6*h*V per token for GPT shapes (no attention term)
    m = MODEL_PRESETS["gpt-7b"]
    h, L, V = m.hidden_size, m.num_layers, m.vocab_size
    assert linear_flops_per_token(m) == 72 * L * h * h + 6 * h * V
    # ... and its attention term 12*L*h*s per token over s keys = 12*d*L per pair per head
    assert attention_flops_per_pair_head(m) * m.num_attention_heads == 12 * L * h


def test_static_memory_each_mode():
    p = TINY.num_parameters
    assert p == 2 * 16 * 8 + (192 + 24 + 64 + 8 + 280 + 32) + 16 == 872
    dist, fsdp = TrainOptions(), TrainOptions(memory_mode="fsdp")
    assert static_memory_bytes(TINY, dist, 4) == 6 * 872 + 12 * 872 // 4 == 7848
    assert static_memory_bytes(TINY, dist, 5) == 5232 + 2093  # ceil(10464 / 5)
    # fsdp: the shards plus Megatron-FSDP's working buffers, 2 layer units x 6 B per parameter
    # (bf16 gathered + fp32 gradients) and one embedding-sized unit (V h = 128) x 6 B
    assert TINY.layer_parameters == 600
    assert static_memory_bytes(TINY, fsdp, 4) == 18 * 872 // 4 + 12 * 600 + 6 * 128 == 11892
    assert static_memory_bytes(TINY, fsdp, 5) == 3140 + 7968  # ceil(15696 / 5) + buffers
    with pytest.raises(HexiSeqError):
        static_memory_bytes(TINY, dist, 0)


def test_activation_memory_with_and_without_recompute():
    layer = 2 * (
        4 * 8 + 2 * 4 + 16 + 16
    )  # norms 2h, QKV in h, proj in a*d, fc1 in h, fc1 out f, fc2 in f
    out = 2 * 2 * 8 + 6 * 16  # final norm + output layer inputs, bf16 + fp32 logits
    assert (layer, out) == (144, 128)
    three = ModelSpec(**(TINY.to_dict() | {"num_layers": 3}))
    assert activation_bytes_per_token(three, TrainOptions()) == 3 * layer + out + layer == 704
    assert (
        activation_bytes_per_token(three, TrainOptions(recompute=True))
        == 3 * 2 * 8 + layer + out + layer
        == 464
    )
    # attention core per group token: q+out (bf16) + LSE (fp32) per head, k+v per kv head, kept
    # per layer, plus one layer's backward transients (d = 4, H = 2, G = 1: 12Hd + 4H + 16Gd)
    bwd = 12 * 2 * 4 + 4 * 2 + 16 * 1 * 4
    assert attention_backward_bytes_per_group_token(three, 2, 1) == bwd == 168
    assert attention_bytes_per_group_token(three, TrainOptions(), 2, 1) == 3 * (2 * 20 + 16) + bwd
    assert (
        attention_bytes_per_group_token(three, TrainOptions(recompute=True), 2, 1)
        == 2 * 20 + 16 + bwd
    )
    # Korthikanti et al.: a GPT layer keeps 34h bytes per token; ours drops the 2h of dropout masks and
    # keeps the 2h FlashAttention output: 26h of own-token tensors + 8h of q, k, v, out (+ LSE)
    m = MODEL_PRESETS["gpt-7b"]
    h, a = m.hidden_size, m.num_attention_heads
    assert layer_activation_bytes_per_token(m) == 26 * h
    core = attention_bytes_per_group_token(
        m, TrainOptions(recompute=True), a, a
    ) - attention_backward_bytes_per_group_token(m, a, a)
    assert core == 8 * h + 4 * a


def test_train_options_validation():
    for bad in (
        {"memory_mode": "zero9"},
        {"micro_batch_size": 0},
        {"data_parallel_size": -1},
        {"capacity_fraction": 1.5},
        {"recompute": "yes"},
    ):
        with pytest.raises(HexiSeqError):
            TrainOptions(**bad)
    assert (
        TrainOptions.for_model(
            ModelSpec(**(TINY.to_dict() | {"micro_batch_size": 3}))
        ).micro_batch_size
        == 3
    )


def test_run_config_modes_flags_and_record_round_trip():
    # the automatic order and what --memory-mode / --recompute leave of it (written out by hand)
    assert modes_to_try("auto", False) == (
        ("distributed_optimizer", False),
        ("fsdp", False),
        ("distributed_optimizer", True),
        ("fsdp", True),
    )
    assert modes_to_try("fsdp", False) == (("fsdp", False), ("fsdp", True))
    assert modes_to_try("auto", True) == (("distributed_optimizer", True), ("fsdp", True))
    with pytest.raises(
        HexiSeqError, match="--memory-mode must be one of auto, distributed_optimizer, fsdp"
    ):
        modes_to_try("zero3", False)
    opts = TrainOptions(
        memory_mode="fsdp", recompute=True, micro_batch_size=2, data_parallel_size=3
    )
    assert megatron_flags(opts)[:2] == ["--use-megatron-fsdp", "--data-parallel-sharding-strategy"]
    assert megatron_flags(opts)[-6:] == [
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
    ]
    assert megatron_flags(TrainOptions()) == ["--use-distributed-optimizer"]
    record = options_record(opts, [TrainOptions(), opts])
    assert record["memory_modes_tried"] == ["distributed_optimizer", "fsdp+recompute"]
    assert options_from_record(check_options_record(record, "layout l.json")) == opts
    with pytest.raises(
        HexiSeqError, match=r"layout l.json: meta.options.recompute must be bool, got 'yes'"
    ):
        check_options_record(record | {"recompute": "yes"}, "layout l.json")
    with pytest.raises(
        HexiSeqError,
        match=r"layout l.json: meta.options: micro_batch_size must be a positive integer",
    ):
        check_options_record(record | {"micro_batch_size": 0}, "layout l.json")


# ---- link model ----------------------------------------------------------------------------------
def _cluster(nodes):
    return cluster_from_dict(
        {
            "name": "t",
            "gpus": T_GPU,
            "nodes": [
                {"name": name, "gpu": "T", "count": count, "network_GBps": net}
                for name, count, net in nodes
            ],
        }
    )


def test_alltoall_two_ranks_one_link():
    one_node = _cluster([("n0", 2, 1)])
    assert alltoall_time_s([[0, 3e9], [5e9, 0]], [0, 1], one_node) == pytest.approx(
        0.5
    )  # 5 GB at 10 GB/s
    assert alltoall_time_s([[7e9, 0], [0, 9e9]], [0, 1], one_node) == 0.0  # local copies only
    two_nodes = _cluster([("n0", 1, 1), ("n1", 1, 2)])
    assert alltoall_time_s([[0, 3e9], [5e9, 0]], [0, 1], two_nodes) == pytest.approx(
        5.0
    )  # min(1, 2) GB/s


def test_alltoall_ports_run_in_parallel_and_serialise_inside():
    c = _cluster([("n0", 2, 1), ("n1", 1, 1)])
    # rank 0 sends 10 GB over NVLink (1 s) and 2 GB over the network (2 s): ports overlap -> 2 s
    assert alltoall_time_s([[0, 10e9, 2e9], [0, 0, 0], [0, 0, 0]], [0, 1, 2], c) == pytest.approx(
        2.0
    )
    # rank 2 receives 1 GB from each of ranks 0 and 1 over its one network port: serialised -> 2 s
    assert alltoall_time_s([[0, 0, 1e9], [0, 0, 1e9], [0, 0, 0]], [0, 1, 2], c) == pytest.approx(
        2.0
    )
    # sub-list of devices: ranks are cluster device numbers
    assert alltoall_time_s([[0, 1e9], [0, 0]], [1, 2], c) == pytest.approx(1.0)
    send, recv = port_times_s([(0, 2, 1e9), (1, 2, 1e9), (0, 1, 10e9)], c)
    assert send == pytest.approx({0: 1.0, 1: 1.0}) and recv == pytest.approx({1: 1.0, 2: 2.0})


def test_pipelined_exposure():
    assert pipelined_exposed_s([5.0], [0.0]) == 0.0
    assert pipelined_exposed_s([5.0, 5.0, 5.0], [99.0, 1.0, 1.0]) == 0.0  # every transfer hidden
    assert pipelined_exposed_s([1.0, 1.0, 1.0], [0.0, 3.0, 3.0]) == pytest.approx(
        4.0
    )  # (3-1) + (3-1)
    # transfers 1 and 2 prefetch during compute 0 (two buffers; block 0 is local) ...
    assert pipelined_exposed_s([4.0, 1.0, 1.0], [0.0, 1.0, 3.0]) == 0.0
    # ... but transfer 3 must wait for compute 1 to free its buffer (t=5): ends 11, not 8
    assert pipelined_exposed_s([1.0, 4.0, 1.0, 1.0], [0.0, 1.0, 1.0, 6.0]) == pytest.approx(5.0)
    assert pipelined_exposed_s([1.0, 10.0, 1.0], [0.0, 1.0, 1.0]) == 0.0


def test_fan_units_sender_serves_every_copy():
    # sender group: member 0 holds kv 0 and 1, member 1 holds kv 1. Receivers pick the least-loaded
    # holder: r0 kv0 -> m0; r1 kv1 -> m1 (load 0 < 1); r2 kv1 -> m0 (tie 1-1, lowest). m0 sends 2 blocks.
    assert fan_units(((0, 1), (1,)), ((0,), (1,), (1,))) == [2, 1, 2]
    assert fan_units(((0, 1), (0, 1)), ((0, 1), (0, 1))) == [
        2,
        2,
    ]  # m0 serves r0's kv0, m1 kv1, ...
    assert fan_units(((0,), (1,)), ((0,), (1,))) == [1, 1]
    assert fan_units(((0, 1),), ((0, 1), ())) == [2, 0]


# ---- whole estimates, by hand ------------------------------------------------------------------
def test_ulysses_estimate_by_hand():
    c = _cluster([("n0", 2, 1)])
    lay = make_layout(
        seq_length=8,
        num_attention_heads=2,
        num_query_groups=2,
        group_sizes=[2],
        segments=[[(0, 3)], [(3, 8)]],
        heads=[[0], [1]],
        hosts=["n0"] * 2,
        gpus=["T"] * 2,
    )
    e = estimate(lay, c, TINY)
    r0, r1 = e.per_rank
    # 1e12 FLOP/s; group pairs 36; a2a: 8 bytes per token-head, worst direction 40 B at 10 GB/s, 4 per layer, fwd+bwd
    assert r0.breakdown["linear_s"] == pytest.approx(3 * 3840e-12)
    assert r1.breakdown["linear_s"] == pytest.approx(5 * 3840e-12)
    assert r0.breakdown["attention_s"] == r1.breakdown["attention_s"] == pytest.approx(36 * 48e-12)
    assert r0.breakdown["a2a_s"] == r1.breakdown["a2a_s"] == pytest.approx(2 * 4 * 4e-9)
    assert r0.breakdown["kv_exchange_s"] == 0.0
    assert r1.time_s == pytest.approx(19.2e-9 + 1.728e-9 + 32e-9)
    assert e.iteration_time_s == r1.time_s and e.bottleneck_rank == 1
    assert e.tokens_per_s == pytest.approx(8 / r1.time_s)
    # memory of rank 0: static (domain 2) + 3 tokens x 416 + 8 group tokens x (36 kept + 116 of
    # the backward: 12Hd + 4H + 16Gd with H = G = 1, d = 4) + a2a buffer 3 x 48
    assert r0.breakdown["mem_static"] == 6 * 872 + 12 * 872 // 2
    assert r0.memory_bytes == 10464 + 3 * 416 + 8 * (36 + 116) + 3 * 48
    assert r0.capacity_bytes == int(0.95 * 2**30) and e.feasible
    # fsdp + recompute on rank 0: ceil(18 P / 2) + FSDP's buffers 7968 + 3 x (2h + layer + out +
    # layer) + 8 x (36 + 116) + 144
    fr = estimate(lay, c, TINY, TrainOptions(memory_mode="fsdp", recompute=True)).per_rank[0]
    assert fr.memory_bytes == (
        18 * 872 // 2 + 7968 + 3 * (16 + 144 + 128 + 144) + 8 * (36 + 116) + 3 * 48
    )
    # recompute: one more forward of compute and of the all-to-alls
    rc = estimate(lay, c, TINY, TrainOptions(recompute=True)).per_rank[1]
    assert rc.breakdown["linear_s"] == pytest.approx(4 / 3 * r1.breakdown["linear_s"])
    assert rc.breakdown["a2a_s"] == pytest.approx(1.5 * r1.breakdown["a2a_s"])
    # micro-batch 2 and dp 3: twice the work, 6x the tokens
    mb = estimate(lay, c, TINY, TrainOptions(micro_batch_size=2, data_parallel_size=3))
    assert mb.iteration_time_s == pytest.approx(2 * e.iteration_time_s)
    assert mb.tokens_per_s == pytest.approx(3 * e.tokens_per_s)


def test_iteration_is_slowest_linear_phase_plus_slowest_attention_phase():
    # one group of 2: rank 0 holds 7 tokens and 0 heads (linear-heavy), rank 1 holds 1 token and
    # both heads (attention-heavy). Each layer's attention synchronises them, so their phases add.
    c = _cluster([("n0", 2, 1)])
    lay = make_layout(
        seq_length=8,
        num_attention_heads=2,
        num_query_groups=2,
        group_sizes=[2],
        segments=[[(0, 7)], [(7, 8)]],
        heads=[[], [0, 1]],
        hosts=["n0"] * 2,
        gpus=["T"] * 2,
    )
    e = estimate(lay, c, TINY)
    r0, r1 = e.per_rank
    rest = [r.time_s - r.breakdown["linear_s"] for r in (r0, r1)]
    assert (
        r0.breakdown["linear_s"] == pytest.approx(7 * 3840e-12)
        and r0.breakdown["attention_s"] == 0.0
    )
    assert r1.breakdown["attention_s"] == pytest.approx(36 * 2 * 48e-12)
    assert e.iteration_time_s == pytest.approx(7 * 3840e-12 + max(rest))
    assert e.iteration_time_s > max(r0.time_s, r1.time_s)


def test_ring_estimate_by_hand():
    c = _cluster([("n0", 1, 1), ("n1", 1, 2)])  # one link of 1 GB/s
    lay = make_layout(
        seq_length=8,
        num_attention_heads=2,
        num_query_groups=2,
        group_sizes=[1, 1],
        segments=zigzag_segments(8, 2),
        heads=[[0, 1], [0, 1]],
        hosts=["n0", "n1"],
        gpus=["T"] * 2,
    )
    e = estimate(lay, c, TINY)
    r0, r1 = e.per_rank
    # rank 0 (q at 0,1,6,7): round 0 = 10 pairs, round 1 = 8 pairs over the 4 visible tokens [2,6).
    # forward: compute 16 FLOP/pair-head x 2 heads; transfer 16 B/token/kv-head x 2 kv heads at 1 GB/s
    comp0, comp1, comm1 = 320e-12, 256e-12, 128e-9
    assert kv_exchange_forward(lay, c, TINY, 1).comm_s == pytest.approx((comm1, 64e-9))
    assert r0.breakdown["kv_exchange_s"] == pytest.approx(
        3 * comm1
    )  # fwd + bwd (K/V again + dK/dV)
    assert r0.breakdown["kv_exposed_s"] == pytest.approx(3 * (comm1 - comp0))
    # rank 1 (q at 2..5) sees only [0, 2) of rank 0: 2 tokens
    assert r1.breakdown["kv_exposed_s"] == pytest.approx(3 * (64e-9 - 320e-12))
    assert r0.time_s == pytest.approx(4 * 3840e-12 + 18 * 2 * 48e-12 + 3 * (comm1 - comp0))
    assert r0.comm_s == pytest.approx(3 * comm1) and r0.breakdown["a2a_s"] == 0.0
    assert comp1 == pytest.approx(8 * 16 * 2 * 1e-12)
    # double-buffered K/V + dK/dV blocks of the largest visible block (4 tokens) for 2 kv heads
    assert r0.breakdown["mem_comm"] == 4 * 2 * (2 + 4) * 4 + 4 * 4 * 2 * 16


def _reference_exchange(layout, cluster, model):
    """Brute force of the documented round model: explicit messages, port model, pipeline."""
    groups = layout.groups
    n = len(groups)
    seg = {g.id: layout.group_segments(g.id) for g in groups}
    comps = {
        r: [
            4
            * model.kv_channels
            * model.num_layers
            * causal_pairs(seg[p.group], seg[p.group])
            * len(p.heads)
            / cluster.devices[r].attention_flops_per_s
        ]
        for r, p in enumerate(layout.ranks)
    }
    comms = {r: [0.0] for r in comps}
    for t in range(1, n):
        msgs, senders = [], {}
        for gi, g in enumerate(groups):
            src = groups[(gi - t) % n]
            q_end = max(e for _, e in seg[g.id])
            vis = sum(max(0, min(e, q_end) - s) for s, e in seg[src.id])
            load = {x: 0 for x in src.ranks}
            for r in g.ranks:
                for k in layout.kv_heads(r):
                    s = min(
                        (x for x in src.ranks if k in layout.kv_heads(x)),
                        key=lambda x: (load[x], x),
                    )
                    load[s] += 1
                    msgs.append((s, r, vis * 4 * model.kv_channels * model.num_layers))
                    senders.setdefault(r, set()).add(s)
        send, recv = port_times_s(msgs, cluster)
        for gi, g in enumerate(groups):
            src = groups[(gi - t) % n]
            q_end = max(e for _, e in seg[g.id])
            if not any(s < q_end for s, _ in seg[src.id]):
                continue
            for r in g.ranks:
                if not layout.ranks[r].heads:
                    continue
                comms[r].append(
                    max([recv.get(r, 0.0)] + [send.get(s, 0.0) for s in senders.get(r, ())])
                )
                comps[r].append(
                    4
                    * model.kv_channels
                    * model.num_layers
                    * len(layout.ranks[r].heads)
                    * causal_pairs(seg[g.id], seg[src.id])
                    / cluster.devices[r].attention_flops_per_s
                )
    return (
        [sum(comms[r]) for r in comps],
        [pipelined_exposed_s(comps[r], comms[r]) for r in comps],
    )


def _random_case(rng):
    nodes = [(f"n{i}", rng.randint(1, 3), rng.choice([1, 2, 4])) for i in range(rng.randint(1, 3))]
    gpus = {
        f"G{i}": {
            "bf16_tflops": rng.choice([0.0005, 0.002, 0.01]),
            "memory_gib": 1,
            "nvlink_GBps": rng.choice([5, 10]),
            "efficiency": 1.0,
        }
        for i in range(2)
    }
    c = cluster_from_dict(
        {
            "name": "r",
            "gpus": gpus,
            "nodes": [
                {"name": nm, "gpu": rng.choice(sorted(gpus)), "count": k, "network_GBps": net}
                for nm, k, net in nodes
            ],
        }
    )
    sizes = []
    for node in c.nodes:  # groups never cross a node
        left = node.count
        while left:
            sizes.append(rng.randint(1, left))
            left -= sizes[-1]
    W, H, G = c.world_size, rng.choice([2, 4, 6]), 0
    G = rng.choice([g for g in (1, 2, H) if H % g == 0])
    seq = rng.randint(len(sizes) * 2, 48)
    owner = [rng.randrange(W) for _ in range(seq)]
    start = 0
    for gi, size in enumerate(sizes):  # every group owns at least one token
        owner[gi] = start + rng.randrange(size)
        start += size
    rng.shuffle(owner)
    while len(
        {next(i for i, s in enumerate(itertools.accumulate(sizes)) if o < s) for o in owner}
    ) < len(sizes):
        owner = [rng.randrange(W) for _ in range(seq)]
    segments = [[] for _ in range(W)]
    for pos, o in enumerate(owner):
        if segments[o] and segments[o][-1][1] == pos:
            segments[o][-1] = (segments[o][-1][0], pos + 1)
        else:
            segments[o].append((pos, pos + 1))
    heads, start = [], 0
    for size in sizes:
        cuts = sorted(rng.choices(range(H + 1), k=size - 1))
        bounds = [0, *cuts, H]
        heads += [list(range(bounds[i], bounds[i + 1])) for i in range(size)]
    for r in range(W):
        if not segments[r] and not heads[r]:
            return None
    lay = make_layout(
        seq_length=seq,
        num_attention_heads=H,
        num_query_groups=G,
        group_sizes=sizes,
        segments=segments,
        heads=heads,
        hosts=[d.node for d in c.devices],
        gpus=[d.gpu.name for d in c.devices],
    )
    return lay, c


def test_vectorised_exchange_matches_brute_force_round_model():
    rng, checked = random.Random(7), 0
    while checked < 60:
        case = _random_case(rng)
        if case is None:
            continue
        lay, c = case
        model = ModelSpec(
            **(
                TINY.to_dict()
                | {
                    "num_attention_heads": lay.num_attention_heads,
                    "num_query_groups": lay.num_query_groups,
                    "seq_length": lay.seq_length,
                    "num_layers": 2,
                }
            )
        )
        got = kv_exchange_forward(lay, c, model, 1)
        comm, exposed = _reference_exchange(lay, c, model)
        assert got.comm_s == pytest.approx(comm, rel=1e-9, abs=1e-18)
        assert got.exposed_s == pytest.approx(exposed, rel=1e-9, abs=1e-15)
        checked += 1


def test_faster_gpu_and_more_memory_change_the_estimate():
    slow = _cluster([("n0", 2, 1)])
    fast = cluster_from_dict(
        {
            "name": "t",
            "gpus": T_GPU | {"T": T_GPU["T"] | {"bf16_tflops": 2}},
            "nodes": [{"name": "n0", "gpu": "T", "count": 2, "network_GBps": 1}],
        }
    )
    lay = make_layout(
        seq_length=8,
        num_attention_heads=2,
        num_query_groups=2,
        group_sizes=[2],
        segments=[[(0, 4)], [(4, 8)]],
        heads=[[0], [1]],
        hosts=["n0"] * 2,
        gpus=["T"] * 2,
    )
    a, b = estimate(lay, slow, TINY), estimate(lay, fast, TINY)
    assert b.per_rank[0].compute_s == pytest.approx(a.per_rank[0].compute_s / 2)


# ---- feasibility, predicted block, mismatches ----------------------------------------------------
def _big_model_case():
    c = cluster_from_dict(
        {
            "name": "m",
            "nodes": [
                {"name": "h", "gpu": "H100-SXM-80GB", "count": 1, "network_GBps": 25},
                {"name": "l", "gpu": "L40S-48GB", "count": 1, "network_GBps": 25},
            ],
        }
    )
    m = ModelSpec(**(MODEL_PRESETS["llama2-7b"].to_dict() | {"seq_length": 32768}))
    lay = make_layout(
        seq_length=m.seq_length,
        num_attention_heads=32,
        num_query_groups=32,
        group_sizes=[1, 1],
        segments=zigzag_segments(m.seq_length, 2),
        heads=[list(range(32))] * 2,
        hosts=["h", "l"],
        gpus=["H100-SXM-80GB", "L40S-48GB"],
    )
    return lay, c, m


def test_memory_problems_and_predicted_block():
    lay, c, m = _big_model_case()
    e = estimate(lay, c, m)
    assert not e.feasible
    problems = e.memory_problems()
    assert len(problems) == 2 and problems[1].startswith("rank 1 (L40S-48GB) needs ")
    assert problems[1].endswith(" GiB > 45.6 GiB (95% of 48 GiB)")
    pred = e.to_predicted()
    assert pred["per_rank"][1]["memory_gib"] == pytest.approx(
        e.per_rank[1].memory_bytes / 2**30, abs=1e-4
    )
    assert pred["iteration_time_s"] == pytest.approx(e.iteration_time_s)
    Layout.from_dict(lay.to_dict() | {"predicted": pred})  # passes the layout JSON schema
    # fsdp + recompute shrink it: static sharded over 2 ranks, activations to layer inputs
    small = estimate(lay, c, m, TrainOptions(memory_mode="fsdp", recompute=True))
    assert all(r.memory_bytes < big.memory_bytes for r, big in zip(small.per_rank, e.per_rank))
    assert small.iteration_time_s > e.iteration_time_s


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"hosts": ["l", "h"]},
            r"layout rank 0 is on l/H100-SXM-80GB but the cluster's device 0 is h/H100-SXM-80GB",
        ),
        (
            {"gpus": ["A100-SXM-80GB", "L40S-48GB"]},
            r"layout rank 0 is on h/A100-SXM-80GB but the cluster's device 0 is h/H100",
        ),
        (
            {"num_query_groups": 8},
            r"the layout has 32 heads in 8 query groups but model 'llama2-7b' has 32 in 32",
        ),
        (
            {"seq_length": 16384, "segments": zigzag_segments(16384, 2)},
            r"seq_length 16384 .* pass --seq-length 16384",
        ),
    ],
)
def test_layout_cluster_model_mismatch_messages(change, message):
    lay, c, m = _big_model_case()
    kw = (
        dict(
            seq_length=m.seq_length,
            num_attention_heads=32,
            num_query_groups=32,
            group_sizes=[1, 1],
            segments=zigzag_segments(m.seq_length, 2),
            heads=[list(range(32))] * 2,
            hosts=["h", "l"],
            gpus=["H100-SXM-80GB", "L40S-48GB"],
        )
        | change
    )
    with pytest.raises(HexiSeqError, match=message):
        estimate(make_layout(**kw), c, m)


def test_world_size_mismatch():
    lay, _, m = _big_model_case()
    c = cluster_from_dict(
        {
            "name": "one",
            "nodes": [{"name": "h", "gpu": "H100-SXM-80GB", "count": 1, "network_GBps": 1}],
        }
    )
    with pytest.raises(HexiSeqError, match=r"the layout has 2 ranks but cluster 'one' has 1 GPUs"):
        estimate(lay, c, m)


def test_alltoall_bytes_with_mqa_and_uneven_heads():
    # H=4 query heads sharing one kv head: k/v go to every member that holds a query head
    mqa = ModelSpec(
        **(TINY.to_dict() | {"num_attention_heads": 4, "num_query_groups": 1, "kv_channels": 4})
    )
    lay = make_layout(
        seq_length=8,
        num_attention_heads=4,
        num_query_groups=1,
        group_sizes=[2],
        segments=[[(0, 2)], [(2, 8)]],
        heads=[[0, 1, 2], [3]],
        hosts=["n0"] * 2,
        gpus=["T"] * 2,
    )
    r = estimate(lay, _cluster([("n0", 2, 1)]), mqa).per_rank[0]
    # 8 B per token-head at 10 GB/s; worst direction: q 6x3 heads, k 6x1, v 6x1, out 6x3 (token-heads)
    assert r.breakdown["a2a_s"] == pytest.approx(2 * 8 * (18 + 6 + 6 + 18) / 10e9)


def test_exchange_bytes_match_the_runtime_schedule():
    """The modelled transfers are the ones the attention runtime posts (attention/peers.py)."""
    from megatron_hexiseq.attention import peers

    rng, checked = random.Random(11), 0
    while checked < 25:
        case = _random_case(rng)
        if case is None or len(case[0].groups) == 1:
            continue
        lay, c = case
        model = ModelSpec(
            **(
                TINY.to_dict()
                | {
                    "num_attention_heads": lay.num_attention_heads,
                    "num_query_groups": lay.num_query_groups,
                    "seq_length": lay.seq_length,
                }
            )
        )
        transfers, steps = peers.build_transfers(lay, 1)
        comm = [0.0] * lay.world_size
        for step in range(steps):
            msgs = [
                (
                    x.src,
                    x.dst,
                    len(x.src_heads) * peers.runs_num_tokens(x.runs) * 4 * model.kv_channels,
                )
                for x in transfers
                if x.step == step
            ]
            send, recv = port_times_s(msgs, c)
            for r in {m[1] for m in msgs}:
                comm[r] += max(
                    [recv.get(r, 0.0)] + [send.get(s, 0.0) for s, d, _ in msgs if d == r]
                )
        assert kv_exchange_forward(lay, c, model, 1).comm_s == pytest.approx(
            comm, rel=1e-9, abs=1e-18
        )
        checked += 1
