"""Layer (a), threads instead of processes: the real attention runtime under NCCL's rules.

``nccl_sim.NcclSim`` replaces ``torch.distributed`` inside ``attention.comm`` and ``attention.groups``
with communicators that follow NCCL: FIFO P2P matching per (communicator, src, dst) with tags
ignored (a matched pair with different tags is a logical mismatch), one serial stream per
communicator, lazy communicator creation (every member must join a group's first operation),
deadlock detection. The runtime itself is unchanged: ``build_hexiseq_groups`` (with its warm-up)
and ``hexiseq_attn_func`` forward and backward, on 200 seeded random layouts (uneven segments and
heads, GQA/MQA, 0-token and 0-head ranks, 2-8 ranks) for every ``comm_chunks`` in 1..4; each rank's
output and gradients are also compared with single-device float64 attention. The layouts rotate
float64 (both CPU kernels; tolerance 1e-10: float64 roundings of reductions over <= 60 tokens),
float32 (1e-5 relative and absolute: u = 6e-8 times the reduction, with margin) and bf16 (the
normwise bounds of ``attention.kernel_check``, oracle on the same bf16-rounded inputs), batch 1-2
and head dims 2-8: this is the broad correctness test of the runtime; tests/test_attention_ranks.py
repeats named cases and a few random ones on real gloo processes.

The simulator's own tests show that it fails on what it must catch: two ranks posting the same
pair of messages in different orders, a wait cycle, a group whose member never joins its first
batch, the runtime with its group warm-up removed, a CPU tensor on a group created with the nccl
backend, and a gloo group created while a member waits for a message.

The online overlap tuner of the Megatron plugin (``overlap.megatron_hooks.OnlineTuningStep``) runs
under the simulator too, with its ``dist`` replaced, in a two-stage pipeline whose stages run
different numbers of forward steps per iteration, on an NCCL and on a gloo default group: both
stages must apply the same chunk counts at the same iterations and agree on the result; and when
one rank alone drifts after tuning, every rank re-tunes at the same iteration.
"""

from __future__ import annotations

import random
import types
from collections.abc import Callable

import pytest
import torch
from nccl_sim import NcclSim, SimError

import megatron_hexiseq.attention.comm as comm
import megatron_hexiseq.attention.groups as groups_mod
from megatron_hexiseq.attention import build_hexiseq_groups, hexiseq_attn_func, reference_attention
from megatron_hexiseq.attention.kernel_check import (
    BACKWARD_ROUNDINGS,
    FORWARD_ROUNDINGS,
    normwise_bound,
    normwise_error,
)
from megatron_hexiseq.attention.testing_layouts import random_layout
from megatron_hexiseq.layout import Layout, make_layout
from megatron_hexiseq.overlap import megatron_hooks, online, search
from megatron_hexiseq.overlap.knobs import Ladder, SearchSpace
from megatron_hexiseq.overlap.monitor import DriftMonitor, MonitorConfig

LAYOUTS = 200
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-5)}


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _simulated(monkeypatch: pytest.MonkeyPatch, world: int) -> NcclSim:
    sim = NcclSim(world)
    monkeypatch.setattr(comm, "dist", sim)
    monkeypatch.setattr(groups_mod, "dist", sim)
    return sim


def _run_layout(
    monkeypatch: pytest.MonkeyPatch,
    lay: Layout,
    chunks: int,
    seed: int,
    kernel: str,
    dtype: torch.dtype = torch.float64,
    batch: int = 1,
    head_dim: int = 4,
) -> NcclSim:
    gen = torch.Generator().manual_seed(seed)
    S, B, D, H, G = lay.seq_length, batch, head_dim, lay.num_attention_heads, lay.num_query_groups
    q, k, v = (
        torch.randn(S, B, n, D, generator=gen, dtype=torch.float64)
        .to(dtype)
        .double()
        .requires_grad_()
        for n in (H, G, G)
    )
    dout = torch.randn(S, B, H * D, generator=gen, dtype=torch.float64).to(dtype).double()
    ref = reference_attention(q, k, v)
    ref.backward(dout)
    sim = _simulated(monkeypatch, lay.world_size)

    def rank_fn(r: int):
        groups = build_hexiseq_groups(lay)
        pos = torch.tensor(lay.ranks[r].positions(), dtype=torch.long)
        ql, kl, vl = (x.detach()[pos].to(dtype).requires_grad_() for x in (q, k, v))
        out = hexiseq_attn_func(ql, kl, vl, groups=groups, kernel=kernel, comm_chunks=chunks)
        out.backward(dout[pos].to(dtype))
        return pos, out.detach(), ql.grad, kl.grad, vl.grad

    for pos, *got in sim.run(rank_fn):
        for name, g, want in zip(("out", "dq", "dk", "dv"), got, (ref, q.grad, k.grad, v.grad)):
            want = want.detach()[pos]
            if dtype in TOL:
                torch.testing.assert_close(
                    g.double(), want, **TOL[dtype], msg=lambda m, n=name: f"{n}: {m}"
                )
            else:
                bound = normwise_bound(
                    dtype,
                    roundings=FORWARD_ROUNDINGS if name == "out" else BACKWARD_ROUNDINGS,
                    reduction=S,
                )
                assert normwise_error(g, want) <= bound, (
                    f"{name}: normwise error {normwise_error(g, want):.3g}"
                )
    return sim


def _variant(i: int) -> dict:
    """Rotate dtype, kernel, batch and head dim over the random layouts."""
    dtype = (torch.float64, torch.float32, torch.float64, torch.bfloat16)[i % 4]
    kernel = "reference" if dtype == torch.float64 and i % 8 == 0 else "auto"
    return dict(dtype=dtype, kernel=kernel, batch=1 + i % 2, head_dim=(4, 2, 8)[i % 3])


@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
def test_runtime_follows_nccl_rules_on_random_layouts(
    monkeypatch: pytest.MonkeyPatch, chunks: int
) -> None:
    rng = random.Random(2026)
    messages = 0
    for i in range(LAYOUTS):
        lay = random_layout(rng, rng.randint(2, 8))
        try:
            sim = _run_layout(monkeypatch, lay, chunks, seed=i, **_variant(i))
        except (SimError, AssertionError) as e:
            raise AssertionError(
                f"layout {i} (world {lay.world_size}, groups "
                f"{[len(g.ranks) for g in lay.groups]}), comm_chunks {chunks}: {e}"
            ) from None
        messages += sim.messages
    assert messages > LAYOUTS  # the layouts do exchange K/V


def test_zero_head_rank_needs_the_warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 holds no heads, so it posts no sub-ring batch; without the warm-up collective the CP
    communicator is never created and the other ranks' first batch waits forever."""
    lay = make_layout(
        seq_length=12,
        num_attention_heads=2,
        num_query_groups=1,
        group_sizes=[2, 1],
        segments=[[(0, 3)], [(3, 6)], [(6, 12)]],
        heads=[[0, 1], [], [0, 1]],
    )
    _run_layout(monkeypatch, lay, 1, seed=0, kernel="reference")  # with the warm-up: fine
    monkeypatch.setattr(groups_mod, "warm_up", lambda group, device: None)
    with pytest.raises(SimError, match=r"deadlock: .*never joined its first operation"):
        _run_layout(monkeypatch, lay, 1, seed=0, kernel="reference")


def _p2p(sim: NcclSim, sends: list[tuple[int, int]], recvs: list[tuple[int, int]]) -> list:
    """Post one batch: (peer, tag) pairs, one-element tensors."""
    ops = [sim.P2POp(sim.isend, torch.ones(1), p, None, t) for p, t in sends]
    ops += [sim.P2POp(sim.irecv, torch.zeros(1), p, None, t) for p, t in recvs]
    return sim.batch_isend_irecv(ops)


def test_sim_detects_messages_posted_in_different_orders() -> None:
    sim = NcclSim(2)

    def fn(r: int) -> None:
        if r == 0:
            works = _p2p(sim, [(1, 1)], []) + _p2p(sim, [(1, 2)], [])
        else:
            works = _p2p(sim, [], [(0, 2)]) + _p2p(sim, [], [(0, 1)])
        for w in works:
            w.wait()

    with pytest.raises(SimError, match="order mismatch.*tag 1 from rank 0 where it expects tag 2"):
        sim.run(fn)


def test_sim_detects_a_wait_cycle() -> None:
    sim = NcclSim(2)

    def fn(r: int) -> None:  # each receives before it sends, in separate batches
        for w in _p2p(sim, [], [(1 - r, 0)]):
            w.wait()
        _p2p(sim, [(1 - r, 0)], [])

    with pytest.raises(SimError, match="deadlock: rank 0 waits for a P2P batch"):
        sim.run(fn)


def test_sim_detects_a_member_missing_from_the_first_batch() -> None:
    sim = NcclSim(3)

    def fn(r: int) -> None:
        g = sim.new_group([0, 1, 2])
        if r < 2:
            ops = [
                sim.P2POp(sim.isend, torch.ones(1), 1 - r, g, 0),
                sim.P2POp(sim.irecv, torch.zeros(1), 1 - r, g, 0),
            ]
            for w in sim.batch_isend_irecv(ops):
                w.wait()

    with pytest.raises(SimError, match=r"members \[2\] never joined"):
        sim.run(fn)


# ---- backends: CPU tensors on NCCL groups, gloo side groups -------------------------------------
def test_sim_rejects_cpu_tensors_on_nccl_groups() -> None:
    sim = NcclSim(2, backend="nccl")

    def fn(r: int) -> None:
        sim.all_reduce(torch.ones(1, device="meta"))  # a stand-in for a CUDA tensor: fine
        side = sim.new_group(backend="gloo")
        t = torch.full((1,), float(r))
        sim.all_reduce(t, op=sim.ReduceOp.MAX, group=side)  # host tensor on gloo: fine
        assert t.item() == 1.0
        sim.all_reduce(t)  # host tensor on the NCCL default group

    with pytest.raises(SimError, match="with a CPU tensor: No backend type associated with device"):
        sim.run(fn)


def test_sim_gloo_group_creation_waits_for_every_member() -> None:
    """gloo connects its members in ``new_group``: a rank that creates it while its peer waits for
    a message from it deadlocks."""
    sim = NcclSim(2, backend="nccl")

    def fn(r: int) -> None:
        pp = sim.new_group([0, 1])
        if r == 1:  # waits for stage 0's activation before it would create the side group
            op = sim.P2POp(sim.irecv, torch.empty(1, device="meta"), 0, pp)
            for w in sim.batch_isend_irecv([op]):
                w.wait()
        sim.new_group(backend="gloo")
        if r == 0:
            op = sim.P2POp(sim.isend, torch.empty(1, device="meta"), 1, pp)
            for w in sim.batch_isend_irecv([op]):
                w.wait()

    with pytest.raises(SimError, match=r"deadlock: rank 0 waits for create #0 on group1\[0, 1\]"):
        sim.run(fn)


# ---- the online overlap tuner in a two-stage pipeline under NCCL -------------------------------
#: forward steps per training iteration of pipeline stage 0 and stage 1: different on purpose (the
#: count depends on the schedule and the stage), the tuner must not depend on it
PP_FORWARDS = (4, 2)
#: step time (s) per comm_chunks seen by each stage: alone, stage 0 would pick 4 chunks; stage 1
#: finds 4 chunks slow, so the slowest-rank time picks 2
STEP_S = ({1: 1.0, 2: 0.8, 4: 0.7, 8: 0.9}, {1: 1.0, 2: 0.8, 4: 0.95, 8: 0.9})
ITERATIONS = 24


class _StageModel:
    """One pipeline stage's model chunk as the tuner sees it: Megatron's config (which ``train()``
    gives ``finalize_model_grads_func``) and the chunk count in force."""

    def __init__(self) -> None:
        self.config = types.SimpleNamespace(finalize_model_grads_func=None)
        self.comm_chunks = 1  # --hexiseq-comm-chunks


def _train_two_stages(sim: NcclSim, rank: int, wrap: Callable) -> tuple[_StageModel, list]:
    """A 2-stage pipeline's training loop: stage 0 sends an activation after every second forward
    step, stage 1 receives one before each of its forward steps; one gradient goes back; then
    Megatron's ``finalize_model_grads_func`` on both (its own collective over both stages: the
    tied embedding gradients). ``wrap(forward_step, clock)`` returns the plugin's forward step."""
    pp = sim.new_group([0, 1])  # the pipeline group (the default backend)
    model, now, applied = _StageModel(), [0.0], []

    def p2p(send: bool, peer: int) -> None:
        op = sim.P2POp(sim.isend if send else sim.irecv, torch.empty(8, device="meta"), peer, pp)
        for w in sim.batch_isend_irecv([op]):
            w.wait()

    def finalize(models, num_tokens, pg_collection=None, force_all_reduce=False) -> None:
        sim.all_reduce(torch.empty(8, device="meta"))

    forward_step = wrap(lambda data, m: None, lambda: now[0])
    model.config.finalize_model_grads_func = finalize
    for _ in range(ITERATIONS):
        for i in range(PP_FORWARDS[rank]):
            if rank == 1:
                p2p(False, 0)
            forward_step(None, model)
            if rank == 0 and i % 2 == 1:
                p2p(True, 1)
        p2p(rank == 1, 1 - rank)  # the gradient of stage 1's input
        now[0] += STEP_S[rank][model.comm_chunks]
        model.config.finalize_model_grads_func([model], None, pg_collection=None)
        applied.append(model.comm_chunks)
    return model, applied


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_online_tuner_agrees_across_two_pipeline_stages(
    monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """The plugin's online tuner on a default group of either backend, in a pipeline whose stages
    run different numbers of forward steps: it decides once per iteration at the end of
    ``finalize_model_grads_func`` on a gloo side group, so no CPU tensor reaches an NCCL group and
    no collective waits inside a forward step (where stage 1 waits for stage 0's activations)."""
    sim = NcclSim(2, backend=backend)
    for module in (megatron_hooks, online, search):
        monkeypatch.setattr(module, "dist", sim)
    space = SearchSpace(ladders=(Ladder(name="attn", knob="comm_chunks", values=(1, 2, 4, 8)),))
    saved: list[list] = [[], []]

    def rank_fn(r: int):
        def wrap(forward_step: Callable, clock: Callable[[], float]) -> Callable:
            return megatron_hooks.OnlineTuningStep(
                forward_step,
                space=space,
                apply_chunks=lambda models, n: [setattr(m, "comm_chunks", n) for m in models],
                on_done=saved[r].append,
                clock=clock,
            )

        return _train_two_stages(sim, r, wrap)

    (m0, applied0), (m1, applied1) = sim.run(rank_fn)
    assert applied0 == applied1  # both stages ran every iteration with the same chunk count
    # iteration 1 ends: the side group and the tuner (level 0); then 1 settling + 4 timed
    # iterations per trial, decided at the end of iterations 6, 11, 16, 21: 2 chunks accepted
    # (0.8 < 1.0), gallop to 8 (0.9: rejected), 4 (max(0.7, 0.95): rejected), 2 chunks kept
    assert applied0 == [1] * 5 + [2] * 5 + [8] * 5 + [4] * 5 + [2] * 4
    assert [[s.levels for s in res[0].trials] for res in saved] == [[(0,), (1,), (3,), (2,)]] * 2
    assert saved[0] == saved[1] and saved[0][0].config.comm_chunks == 2
    assert m0.config.finalize_model_grads_func is not m1.config.finalize_model_grads_func
    assert sim.groups[1].backend == "gloo"  # the side group; group 0 is the pipeline's


def test_online_tuner_retunes_on_every_rank_when_one_rank_drifts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After tuning, only rank 1 gets slower: every rank sees the slowest rank's times, so the drift
    monitor fires on both at the same iteration and they re-tune together (a monitor fed with its
    own rank's times fires on rank 1 alone, whose re-tune then waits for rank 0 forever)."""
    sim = NcclSim(2, backend="nccl")
    monkeypatch.setattr(online, "dist", sim)
    monkeypatch.setattr(search, "dist", sim)
    space = SearchSpace(ladders=(Ladder(name="attn", knob="comm_chunks", values=(1, 2)),))

    def rank_fn(r: int) -> tuple[list[int], int]:
        applied: list[int] = []
        tuner = online.OnlineTuner(
            space,
            lambda c: applied.append(c.comm_chunks),
            settle_steps=0,
            steps_per_trial=1,
            gallop=False,
            group=sim.new_group(backend="gloo"),
            monitor=DriftMonitor(MonitorConfig(window=2, patience=1, cooldown=0)),
        )
        for it in range(20):
            step_s = {1: 1.0, 2: 0.8}[applied[-1]] * (1.5 if r == 1 and it >= 8 else 1.0)
            tuner.on_step(step_s, 0.0, [step_s])
        return applied, tuner.monitor.triggers

    (applied0, fired0), (applied1, fired1) = sim.run(rank_fn)
    assert applied0 == applied1 == [1, 2, 2, 1, 2, 2] and fired0 == fired1 == 1
