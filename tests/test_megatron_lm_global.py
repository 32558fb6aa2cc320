"""``--hexiseq-global-batch`` through real Megatron-LM ``core_v0.16.1``: layer (b), gloo ranks vs 1.

Needs ``MEGATRON_LM`` (as tests/test_megatron_lm.py). Every rank parses its flags with Megatron-LM's
own ``parse_args`` + ``validate_args``, builds the GPT through ``pretrain_gpt``'s ``model_provider``
via ``plugin.model_provider`` (which installs the seams), reads a stand-in GPT dataset with EOD
tokens (tests/test_global_data.py's, Megatron's own masks and positions) through the data loader
the plugin put in ``megatron.training.training.build_pretraining_data_loader``, and runs its
domain's micro-batches of each step through ``pretrain_gpt.get_batch`` (the plugin's prepared
micro-batches: the step's global batch scheduled over the domains, each micro-batch ``[1, N]``
with its documents). Megatron's training loop does not run on CPU, so the micro-batch count comes
from the schedule seam (a job: ``HexiSeqSchedule``) or Megatron's own count (replicas) and the
steps are driven by hand: forward, the masked loss sum, backward; the gradients are summed over
the ranks and divided by the global batch's loss tokens, as ``finalize_model_grads`` does.

Two runs, 2 steps each, global batches of 4 samples of 48 tokens: the job of
tests/test_job_runtime.py (1 + 2 ranks, 3 and 1 micro-batches) and the 2-rank layout of its
second domain as ``--hexiseq-layout`` with 2 data-parallel replicas (4 ranks, 2 micro-batches
each). Against stock single-process Megatron (CP 1, Megatron's ``DotProductAttention`` with the
dataset's dense document mask) on each step's 4 samples:

- every token of every step is held by exactly one rank (every document read once, by one
  domain, none dropped);
- per-token losses of both steps and every parameter gradient of step 0 agree within the fp32
  reordering bound of tests/test_megatron_gpt.py (N = the global batch's tokens);
- the comparison can fail: the reference's gradients with one document dropped from, or counted
  twice in, the loss are more than 10x that bound away; and a wrong schedule fails it (mutation,
  the replicas run): the longest document of each step dropped from its micro-batch, or scheduled
  a second time into the other domain's first micro-batch (every rank alike, so the agreement
  checks pass), puts the gradients more than 10x the bound away and breaks the held-once check.
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
from test_global_data import EodSamples
from test_job_runtime import job_1_2
from test_megatron_documents import COMMON, _parse, hexiseq_model, stock_model
from test_megatron_gpt import FP32_UNIT_ROUNDOFF

from megatron_hexiseq.megatron.job_runtime import domain_layout
from megatron_hexiseq.testbed.spawn import run_ranks

MEGATRON_LM = os.environ.get("MEGATRON_LM")
pytestmark = pytest.mark.skipif(
    not MEGATRON_LM, reason="set MEGATRON_LM=<Megatron-LM core_v0.16.1 checkout>"
)

S, B, STEPS, LAYERS, SEED = 48, 4, 2, 2, 5


def _argv() -> list[str]:
    """tests/test_megatron_documents.py's Megatron flags (2 layers, S = 48, EOD 127, the packed
    document flags) with this file's global batch and steps; the micro-batch size comes per run."""
    values = {
        "--global-batch-size": str(B),
        "--train-iters": str(STEPS),
        "--micro-batch-size": None,
    }
    out, it = [], iter(COMMON)
    for a in it:
        if a in values:
            next(it)
            out += [a, values[a]] if values[a] is not None else []
        else:
            out.append(a)
    assert out[out.index("--num-layers") + 1] == str(LAYERS) and out.count(str(S)) == 2
    return out


ARGV = _argv()
HEXISEQ = [
    "--cp-comm-type",
    "hexiseq",
    "--hexiseq-kernel",
    "reference",
    "--hexiseq-global-batch",
    "--micro-batch-size",
    "1",
]


def _data(seed: int = SEED) -> EodSamples:
    return EodSamples(STEPS * B, S, seed=seed, every=7)


class _Mutated:
    """A wrong schedule (module docstring): every step's longest unit dropped from its micro-batch
    (``drop``), or also scheduled into the other domain's first micro-batch (``twice``)."""

    def __init__(self, scheme, mutation: str) -> None:
        self.scheme, self.mutation = scheme, mutation

    def schedule(self, step: int, lengths):
        bins = [[list(b) for b in d] for d in self.scheme.schedule(step, lengths)]
        u = max(range(len(lengths)), key=lambda x: (lengths[x], -x))
        d, k = next((d, k) for d, bs in enumerate(bins) for k, b in enumerate(bs) if u in b)
        if self.mutation == "drop":
            bins[d][k].remove(u)
        else:
            bins[(d + 1) % len(bins)][0].append(u)
        return bins

    def layout(self, domain: int, lengths):
        return self.scheme.layout(domain, lengths)


def _hexiseq_worker(
    rank: int, world: int, checkout: str, flags: list[str], mutation: str | None = None
) -> dict:
    sys.path.insert(0, checkout)
    import pretrain_gpt as stock
    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron.training import training

    from megatron_hexiseq.megatron.job_plugin import ScheduleGetter

    args = _parse(ARGV + HEXISEQ + flags, rank, world)
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=1, context_parallel_size=args.context_parallel_size
    )
    model = hexiseq_model(stock)
    getter = training.get_forward_backward_func
    if isinstance(getter, ScheduleGetter):  # a job: the domain's count, through the seam
        count = getter().micro_batches
    else:  # replicas: Megatron's own count, the same on every replica
        count = B // (args.micro_batch_size * mpu.get_data_parallel_world_size())
    loader = training.build_pretraining_data_loader(_data(), 0)
    iterator = RerunDataIterator(iter(loader))
    ahead = stock.get_batch_on_this_tp_rank
    if mutation is not None:  # read when the stream is first used, below
        ahead.streams.preparer.scheme = _Mutated(ahead.streams.preparer.scheme, mutation)
    out: dict = {"count": count, "steps": [], "loss_tokens": 0.0, "samples": []}
    for step in range(STEPS):
        losses, origins = [], []
        for _ in range(count):
            tokens, labels, loss_mask, _, position_ids, _ = stock.get_batch(iterator)
            item = ahead.current
            with contextlib.nullcontext() if step == 0 else torch.no_grad():
                per_token = model(tokens, position_ids, None, labels=labels)
            if step == 0:
                (per_token.float() * loss_mask).sum().backward()
                out["loss_tokens"] += float(loss_mask.sum())
                out["samples"].append(sorted(set((item.origins // S).tolist())))
            losses.append(per_token.detach().double().reshape(-1))
            origins.append(item.origins)
        out["steps"].append((torch.cat(losses), torch.cat(origins)))
    out["grads"] = {n: p.grad.double().clone() for n, p in model.named_parameters()}
    out["params"] = sum(float(p.detach().double().sum()) for p in model.parameters())
    out["exposed"] = len(ahead.exposed_s)
    mpu.destroy_model_parallel()
    return out


def _reference_worker(rank: int, world: int, checkout: str, seed: int = SEED) -> dict:
    """Stock single-process Megatron on each step's 4 samples (dense document mask); step 0's
    gradients of the global per-token loss, and of the same loss with the longest document of
    step 0 dropped, then counted twice."""
    sys.path.insert(0, checkout)
    import pretrain_gpt as stock
    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    from megatron_hexiseq.megatron.config import cpu_device_shim

    _parse(ARGV + ["--micro-batch-size", str(B)], rank, world)
    mpu.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=1)
    data = _data(seed)
    out: dict = {"losses": [], "grads": []}
    with cpu_device_shim():
        model = stock_model(stock)
        out["params"] = sum(float(p.detach().double().sum()) for p in model.parameters())
        out["initial"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        for step in range(STEPS):
            samples = [data[i] for i in range(step * B, (step + 1) * B)]
            batch = {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
            masks = [
                _get_ltor_masks_and_position_ids(s["tokens"], 127, True, True, True, True)[0]
                for s in samples
            ]
            mask = batch["loss_mask"]
            total = float(mask.sum())
            weights = [mask]
            if step == 0:  # the longest document of step 0 dropped, then counted twice
                docs = [d for i in range(B) for d in data.documents(i)]
                i, a, b = max(docs, key=lambda d: (d[2] - d[1], d))
                for factor in (0.0, 2.0):
                    w = mask.clone()
                    w[i, a:b] *= factor
                    weights.append(w)
            for k, w in enumerate(weights):
                model.zero_grad(set_to_none=True)
                losses = model(
                    batch["tokens"],
                    batch["position_ids"],
                    torch.stack(masks),
                    labels=batch["labels"],
                )
                if k == 0:
                    out["losses"].append(losses.detach().double().reshape(-1))
                if step == 0:
                    ((losses.float() * w).sum() / float(w.sum())).backward()
                    out["grads"].append(
                        {n: p.grad.double().clone() for n, p in model.named_parameters()}
                    )
            out.setdefault("loss_tokens", total)
    mpu.destroy_model_parallel()
    return out


def _bound() -> float:
    """tests/test_megatron_gpt.py's fp32 two-orderings bound for N = the global batch's tokens."""
    n = B * S
    gamma = n * FP32_UNIT_ROUNDOFF / (1 - n * FP32_UNIT_ROUNDOFF)
    return 2 * gamma * (LAYERS + 1)


def _distance(got: dict, want: dict) -> float:
    """Largest elementwise difference relative to each tensor's largest magnitude."""
    return max(
        float((got[n] - w).abs().max() / w.abs().max()) for n, w in want.items() if w.abs().max()
    )


@pytest.fixture(scope="module")
def reference():
    return run_ranks(_reference_worker, 1, MEGATRON_LM, timeout_s=900)[0]


def _runs(tmp_path) -> dict:
    job = job_1_2()
    job_path, layout_path = tmp_path / "job.json", tmp_path / "layout.json"
    job.save(job_path)
    domain_layout(job, 1)[0].save(layout_path)  # a 2-rank layout with what plan records
    return {
        "job": (3, ["--hexiseq-job", str(job_path), "--context-parallel-size", "3"]),
        "replicas": (4, ["--hexiseq-layout", str(layout_path), "--context-parallel-size", "2"]),
    }


def _compare(results: list[dict], ref: dict) -> dict:
    """The run against the reference: how often each token of each step was held (1 each is
    right), the largest per-token loss difference and step 0's gradient distance (``_distance``,
    and the largest per-parameter norm of the difference relative to the reference's)."""
    import torch

    held, loss_err = [], 0.0
    for step in range(STEPS):
        count = torch.zeros(B * S, dtype=torch.long)
        losses = torch.zeros(B * S, dtype=torch.float64)
        for res in results:
            got, origins = res["steps"][step]
            count.index_add_(0, origins, torch.ones_like(origins))
            losses[origins] = got
        held.append(count.tolist())
        loss_err = max(loss_err, float((losses - ref["losses"][step]).abs().max()))
    total = sum(res["loss_tokens"] for res in results)
    grads = {n: sum(res["grads"][n] for res in results) / total for n in ref["grads"][0]}
    want = ref["grads"][0]
    norm_err = max(
        float(torch.linalg.vector_norm(grads[n] - w) / torch.linalg.vector_norm(w))
        for n, w in want.items()
    )
    return {
        "held": held,
        "loss_err": loss_err,
        "grad_err": _distance(grads, want),
        "norm_err": norm_err,
        "loss_tokens": total,
        "grads": grads,
    }


@pytest.mark.parametrize("run", ["job", "replicas"])
def test_global_batch_matches_single_process(tmp_path, reference, run) -> None:
    world, flags = _runs(tmp_path)[run]
    results = run_ranks(_hexiseq_worker, world, MEGATRON_LM, flags, timeout_s=900)
    ref, tol = reference, _bound()
    counts = [res["count"] for res in results]
    assert counts == ([3, 1, 1] if run == "job" else [2, 2, 2, 2])
    for res in results:
        assert abs(res["params"] - ref["params"]) < 1e-9  # the same weights
        assert res["exposed"] == STEPS * res["count"]
    # the scheduler's micro-batches are bins of documents, not the loader's samples
    assert any(len(x) > 1 for res in results for x in res["samples"])
    got = _compare(results, ref)
    print(
        f"{run}: bound {tol:.3g}; loss {got['loss_err']:.3g}, grad {got['grad_err']:.3g}, "
        f"grad norm {got['norm_err']:.3g}"
    )
    # every token once: no document lost or read twice
    assert got["held"] == [[1] * (B * S)] * STEPS
    assert got["loss_err"] <= tol * max(float(x.abs().max()) for x in ref["losses"])
    assert got["loss_tokens"] == ref["loss_tokens"]
    want, dropped, doubled = ref["grads"]
    assert len(want) >= 4 * LAYERS
    assert got["grad_err"] <= tol and got["norm_err"] <= tol, got
    # the comparison can fail: one document dropped or counted twice is far outside the bound
    for wrong in (dropped, doubled):
        assert _distance(got["grads"], wrong) > 10 * tol


@pytest.mark.parametrize("mutation", ["drop", "twice"])
def test_a_wrong_schedule_fails_the_comparison(tmp_path, reference, mutation) -> None:
    world, flags = _runs(tmp_path)["replicas"]
    results = run_ranks(_hexiseq_worker, world, MEGATRON_LM, flags, mutation, timeout_s=900)
    got, tol = _compare(results, reference), _bound()
    print(f"{mutation}: bound {tol:.3g}; grad {got['grad_err']:.3g}")
    assert got["held"][0] != [1] * (B * S)
    assert got["grad_err"] > 10 * tol, got["grad_err"]
