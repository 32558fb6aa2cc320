"""GPU acceptance check of the attention runtime (one GPU, <= 10 minutes): one JSON + markdown.

Run by ``scripts/gpu_check.sh``. Four parts, each a pass/fail with its figures:

1. kernels: blocks cut from seeded random layouts (uneven segments and heads, GQA, 4-8 ranks,
   2K-6K tokens): one rank's work is emulated on one device (its group sequence, the local causal
   block, the mask-free calls of every received block, merged by LSE, recompute backward) with each
   fused kernel in bf16, and compared with float64 single-device attention of the same rows
   (normwise bounds of ``attention.kernel_check``).
2. memory: peak extra CUDA memory of one local causal block (S x S) and one received block
   (S queries x S keys) forward+backward, bf16, H=32/G=8, D=128, at S = 8K, 16K, 32K: must grow like
   S (ratio ~2 per doubling), not S^2 (~4).
3. megatron: a world-of-1 megatron-core GPT (bf16 through ``Float16Module``, 2 layers, GQA, RoPE),
   stock core attention (Megatron's ``DotProductAttention``) vs ``HexiSeqCoreAttention`` on a
   one-rank layout, 3 AdamW steps from the same weights on the same data: equal losses within the
   bf16 bound.
4. throughput: tokens/s of HexiSeq attention fwd+bwd on an even one-rank layout against
   ``torch.nn.functional.scaled_dot_product_attention`` (flash backend) on the same tokens, bf16,
   S = 32K, H=32/G=8, D=128 (target: HexiSeq >= 0.9x SDPA).

``--device cpu --quick`` runs the same code at toy sizes on CPU (a smoke test of the script).

    python bench/gpu_check.py --out results/gpu_check            # on a GPU machine
    python bench/gpu_check.py --device cpu --quick --out /tmp/g  # anywhere
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch
import torch.distributed as dist
from _common import write_outputs

from megatron_hexiseq.attention import build_hexiseq_groups, hexiseq_attn_func
from megatron_hexiseq.attention.kernel_check import (
    BACKWARD_ROUNDINGS,
    FORWARD_ROUNDINGS,
    normwise_bound,
    normwise_error,
)
from megatron_hexiseq.attention.kernels import Kernel, block_backward, block_forward, merge_into
from megatron_hexiseq.attention.peers import build_schedule, runs_positions
from megatron_hexiseq.attention.reference import reference_attention
from megatron_hexiseq.attention.testing_layouts import random_layout
from megatron_hexiseq.layout import make_layout
from megatron_hexiseq.megatron.config import cpu_device_shim, transformer_config
from megatron_hexiseq.megatron.loss import per_token_loss
from megatron_hexiseq.megatron.reference_attention import LocalCausalAttention
from megatron_hexiseq.megatron.rope import install_rope
from megatron_hexiseq.megatron.runtime import RunShape, build_runtime
from megatron_hexiseq.megatron.spec import hexiseq_spec
from megatron_hexiseq.model import ModelSpec


def _init_world(device: torch.device) -> None:
    """A process group of one (NCCL on a GPU) on a free local port."""
    if dist.is_initialized():
        return
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- 1. kernels on blocks cut from random layouts ----------------------------------------------
def emulate_rank(lay, rank: int, q, k, v, dout, kernel: Kernel, dtype: torch.dtype):
    """One rank's sub-ring work on one device, all heads: (rows, out, dq, dk_full, dv_full)."""
    sched = build_schedule(lay, rank)
    rows = torch.tensor(runs_positions(sched.q_runs), device=q.device)
    H, G = q.shape[2], k.shape[2]
    kv_of_head = torch.arange(H, device=q.device) // (H // G)
    kw = dict(kv_of_head_H=kv_of_head, scale=q.shape[-1] ** -0.5, kernel=kernel)
    qm, km, vm, dom = (x[rows].to(dtype) for x in (q, k, v, dout))
    out, lse = block_forward(qm, km, vm, causal=True, **kw)
    out, lse = out.float(), lse.float()
    blocks = []
    for st in sched.steps:
        if not st.computes:
            continue
        cols = torch.tensor(runs_positions(st.k_runs), device=q.device)
        kb, vb = k[cols].to(dtype), v[cols].to(dtype)
        blocks.append((st, cols, kb, vb))
        for lo, hi, n in st.calls:
            o, l_ = block_forward(qm[lo:hi], kb[:n], vb[:n], causal=False, **kw)
            out[lo:hi], lse[lo:hi] = merge_into(out[lo:hi], lse[lo:hi], o, l_)
    final = out.to(dtype)
    dq, dk, dv = block_backward(dom, qm, km, vm, final, lse, causal=True, **kw)
    dk_full, dv_full = (
        torch.zeros_like(k, dtype=torch.float32),
        torch.zeros_like(v, dtype=torch.float32),
    )
    dk_full[rows], dv_full[rows] = dk, dv
    for st, cols, kb, vb in blocks:
        for lo, hi, n in st.calls:
            gq, gk, gv = block_backward(
                dom[lo:hi], qm[lo:hi], kb[:n], vb[:n], final[lo:hi], lse[lo:hi], causal=False, **kw
            )
            dq[lo:hi] += gq
            dk_full[cols[:n]] += gk
            dv_full[cols[:n]] += gv
    return rows, final, dq, dk_full, dv_full


def check_kernels(
    device: torch.device, kernels: list[Kernel], layouts: int, quick: bool
) -> dict[str, Any]:
    rng = random.Random(7)
    dtype = torch.bfloat16
    D = 16 if quick else 128
    worst: dict[str, float] = {}
    bounds: dict[str, float] = {}
    cases = 0
    for i in range(layouts):
        lay = random_layout(
            rng,
            rng.randint(4, 8),
            seq_length=rng.randint(64, 128) if quick else rng.randint(2048, 6144),
            heads=rng.choice([(8, 2), (16, 4), (8, 8), (12, 4)]),
        )
        S, H, G = lay.seq_length, lay.num_attention_heads, lay.num_query_groups
        gen = torch.Generator().manual_seed(i)
        q = torch.randn(S, 1, H, D, generator=gen).to(dtype).to(device)
        k, v = (torch.randn(S, 1, G, D, generator=gen).to(dtype).to(device) for _ in range(2))
        # one rank per group that holds heads (a 0-head rank posts no sub-ring step): the group sequence, all heads
        for r in (next(x for x in g.ranks if lay.ranks[x].heads) for g in lay.groups):
            gen_r = torch.Generator().manual_seed(1000 * i + r)
            dout = torch.zeros(S, 1, H, D, device=device, dtype=dtype)
            rows = torch.tensor(runs_positions(build_schedule(lay, r).q_runs), device=device)
            dout[rows] = torch.randn(len(rows), 1, H, D, generator=gen_r).to(dtype).to(device)
            qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
            ref = reference_attention(qd, kd, vd).view(S, 1, H, D)
            ref.backward(dout.double())
            for kernel in kernels:
                got_rows, out, dq, dk, dv = emulate_rank(lay, r, q, k, v, dout, kernel, dtype)
                for name, g, want, rnd in (
                    ("out", out, ref.detach()[got_rows], FORWARD_ROUNDINGS),
                    ("dq", dq, qd.grad[got_rows], BACKWARD_ROUNDINGS),
                    ("dk", dk, kd.grad, BACKWARD_ROUNDINGS),
                    ("dv", dv, vd.grad, BACKWARD_ROUNDINGS),
                ):
                    key = f"{kernel.value}/{name}"
                    worst[key] = max(worst.get(key, 0.0), normwise_error(g, want))
                    bounds[key] = normwise_bound(dtype, roundings=rnd, reduction=S, device=device)
                cases += 1
    ok = all(worst[k] <= bounds[k] for k in worst)
    return {"pass": ok, "cases": cases, "worst_normwise_error": worst, "bounds": bounds}


# ---- 2. memory of local and received blocks ----------------------------------------------------
def check_memory(device: torch.device, quick: bool) -> dict[str, Any]:
    if device.type != "cuda":
        return {"pass": True, "skipped": "CUDA memory counters only"}
    H, G, D = 32, 8, 128
    kernel = Kernel.FLASH
    rows = []
    for S in (1024, 2048, 4096) if quick else (8192, 16384, 32768):
        for kind in ("local", "received"):
            q = torch.randn(S, 1, H, D, device=device, dtype=torch.bfloat16)
            k, v = (torch.randn(S, 1, G, D, device=device, dtype=torch.bfloat16) for _ in range(2))
            kv_of_head = torch.arange(H, device=device) // (H // G)
            kw = dict(causal=kind == "local", kv_of_head_H=kv_of_head, scale=D**-0.5, kernel=kernel)
            _sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            out, lse = block_forward(q, k, v, **kw)
            block_backward(torch.ones_like(q), q, k, v, out, lse, **kw)
            _sync(device)
            rows.append(
                {
                    "S": S,
                    "block": kind,
                    "peak_extra_mib": (torch.cuda.max_memory_allocated(device) - base) / 2**20,
                }
            )
            del q, k, v, out, lse
    ratios = {}
    for kind in ("local", "received"):
        pts = [r for r in rows if r["block"] == kind]
        ratios[kind] = [b["peak_extra_mib"] / a["peak_extra_mib"] for a, b in zip(pts, pts[1:])]
    ok = all(
        r < 3.0 for rs in ratios.values() for r in rs
    )  # linear: 2 per doubling; S^2 would give 4
    return {"pass": ok, "rows": rows, "growth_per_doubling": ratios}


# ---- 3. world-of-1 megatron-core GPT, stock vs HexiSeq, bf16 -----------------------------------
def check_megatron(device: torch.device, quick: bool) -> dict[str, Any]:
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module

    S = 256 if quick else 4096
    h = 256 if not quick else 64
    tiny = ModelSpec(
        name="gpu-check",
        num_layers=2,
        hidden_size=h,
        num_attention_heads=8,
        num_query_groups=2,
        ffn_hidden_size=512 if not quick else 96,
        vocab_size=512,
        kv_channels=h // 8,
        swiglu=True,
        seq_length=S,
        normalization="RMSNorm",
        add_bias_linear=False,
    )
    lay = make_layout(
        seq_length=S,
        num_attention_heads=8,
        num_query_groups=2,
        group_sizes=[1],
        segments=[[(0, S)]],
        heads=[list(range(8))],
    )
    _init_world(device)
    mpu.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=1)
    losses = {}
    try:
        for name in ("stock", "hexiseq"):
            config = transformer_config(tiny)
            config.bf16 = True
            spec = get_gpt_layer_local_spec(normalization=tiny.normalization)
            runtime = None
            if name == "hexiseq":
                run = RunShape(
                    world_size=1,
                    tensor_model_parallel_size=1,
                    pipeline_model_parallel_size=1,
                    context_parallel_size=1,
                    seq_length=S,
                    num_attention_heads=8,
                    num_query_groups=2,
                    params_dtype="bfloat16",
                    head_dim=tiny.hidden_size // 8,
                )
                runtime = build_runtime(lay, run, cp_group=mpu.get_context_parallel_group())
                spec = hexiseq_spec(spec, runtime)
            elif device.type == "cpu":
                from megatron.core.transformer.spec_utils import ModuleSpec

                spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
                    module=LocalCausalAttention
                )
            torch.manual_seed(1234)
            with cpu_device_shim():
                model = GPTModel(
                    config=config,
                    transformer_layer_spec=spec,
                    vocab_size=tiny.vocab_size,
                    max_sequence_length=S,
                    position_embedding_type="rope",
                    share_embeddings_and_output_weights=False,
                )
            if runtime is not None:
                install_rope(model, list(range(S)))
            model = Float16Module(config, model.to(device))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            g = torch.Generator().manual_seed(5)
            losses[name] = []
            with (
                cpu_device_shim()
            ):  # stock RoPE asks for torch.cuda.current_device() (a no-op on GPU)
                _train(model, opt, g, tiny.vocab_size, S, device, losses[name])
    finally:
        mpu.destroy_model_parallel()
    u = torch.finfo(torch.bfloat16).eps / 2
    diffs = [abs(a - b) / abs(a) for a, b in zip(losses["stock"], losses["hexiseq"])]
    return {
        "pass": max(diffs) <= 8 * u,
        "losses": losses,
        "max_relative_difference": max(diffs),
        "bound": 8 * u,
    }


def _train(model, opt, g, vocab: int, S: int, device: torch.device, losses: list[float]) -> None:
    for _ in range(3):
        text = torch.randint(0, vocab, (1, S + 1), generator=g).to(device)
        out = model(text[:, :-1], torch.arange(S, device=device)[None], None, labels=text[:, 1:])
        loss_sum, n = per_token_loss(out.float(), torch.ones(1, S, device=device))
        opt.zero_grad()
        (loss_sum / n).backward()
        opt.step()
        losses.append(float(loss_sum / n))


# ---- 4. throughput against torch SDPA ----------------------------------------------------------
def check_throughput(device: torch.device, quick: bool) -> dict[str, Any]:
    S, H, G, D = (1024, 8, 2, 32) if quick else (32768, 32, 8, 128)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lay = make_layout(
        seq_length=S,
        num_attention_heads=H,
        num_query_groups=G,
        group_sizes=[1],
        segments=[[(0, S)]],
        heads=[list(range(H))],
    )
    _init_world(device)
    groups = build_hexiseq_groups(lay, device=device)
    q = torch.randn(S, 1, H, D, device=device, dtype=dtype, requires_grad=True)
    k, v = (
        torch.randn(S, 1, G, D, device=device, dtype=dtype, requires_grad=True) for _ in range(2)
    )
    dout = torch.randn(S, 1, H * D, device=device, dtype=dtype)

    def hexiseq() -> None:
        hexiseq_attn_func(q, k, v, groups=groups).backward(dout)

    def sdpa() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(
            q.permute(1, 2, 0, 3),
            k.permute(1, 2, 0, 3),
            v.permute(1, 2, 0, 3),
            is_causal=True,
            enable_gqa=True,
        )
        out.permute(2, 0, 1, 3).reshape(S, 1, H * D).backward(dout)

    times = {}
    for name, fn in (("hexiseq", hexiseq), ("sdpa", sdpa)):
        fn()  # warm-up
        _sync(device)
        reps = 3 if quick else 10
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        _sync(device)
        times[name] = (time.perf_counter() - start) / reps
    ratio = times["sdpa"] / times["hexiseq"]
    return {
        "pass": ratio >= 0.9 or device.type != "cuda",
        "seq_length": S,
        "tokens_per_s": {k: S / t for k, t in times.items()},
        "hexiseq_over_sdpa": ratio,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--quick", action="store_true", help="toy sizes (a smoke test of this script)")
    p.add_argument("--layouts", type=int, default=12, help="random layouts for the kernel part")
    p.add_argument("--out", default="results/gpu_check")
    a = p.parse_args()
    device = torch.device(a.device)
    kernels = [Kernel.FLASH, Kernel.EFFICIENT] if device.type == "cuda" else [Kernel.CPU_FLASH]
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    for name, fn in (
        ("kernels", lambda: check_kernels(device, kernels, a.layouts, a.quick)),
        ("memory", lambda: check_memory(device, a.quick)),
        ("megatron", lambda: check_megatron(device, a.quick)),
        ("throughput", lambda: check_throughput(device, a.quick)),
    ):
        start = time.perf_counter()
        try:
            result[name] = fn()
        except Exception as e:  # report and go on with the other parts  # noqa: BLE001
            result[name] = {"pass": False, "error": f"{type(e).__name__}: {e}"}
        result[name]["seconds"] = round(time.perf_counter() - start, 1)
        print(f"{name}: {'PASS' if result[name]['pass'] else 'FAIL'} {result[name]}", flush=True)
    result["pass"] = all(result[n]["pass"] for n in ("kernels", "memory", "megatron", "throughput"))
    lines = ["| part | pass | figures |", "|---|---|---|"]
    for n in ("kernels", "memory", "megatron", "throughput"):
        figures = {k: v for k, v in result[n].items() if k != "pass"}
        lines.append(f"| {n} | {'yes' if result[n]['pass'] else 'NO'} | `{figures}` |")
    write_outputs(
        a.out,
        "gpu_check",
        data=result,
        title=f"GPU check on {result['device']}",
        table="\n".join(lines),
    )
    raise SystemExit(0 if result["pass"] else 1)


if __name__ == "__main__":
    main()
