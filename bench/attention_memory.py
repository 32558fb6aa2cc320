"""Peak memory of HexiSeq attention forward+backward against the sequence length (CPU, gloo).

For each sequence length S a fresh spawn runs one forward+backward of ``hexiseq_attn_func`` and
reports, per rank, the growth of its peak resident memory over the run (``ru_maxrss`` after the
call minus before it, inputs already allocated; CPU torch has no allocator peak counter, so this is
an approximation that counts what the run had to touch beyond its inputs). Layouts: all S tokens on
one rank, and an uneven 4-rank layout (A2A groups [2, 1, 1], uneven segments and heads, every block
kind). Kernels: ``auto`` (the fused CPU flash kernel with the mask-free schedule) and, for the
shorter lengths, ``reference`` (matmul + softmax with [S, T] scores: the S^2 curve to compare with).
Reported: MiB per rank (the largest rank), MiB per 1K tokens of that rank, and the time.
The linear claim is: MiB / token stays flat for ``auto`` while it grows with S for ``reference``.

    python bench/attention_memory.py                       # S = 4K..32K, writes results/bench/attention_memory.*
    python bench/attention_memory.py --seqs 2048 4096 --reference-up-to 4096

``--gqa``: peak memory of ONE layer's attention forward+backward with GQA (H = 32 query heads,
H/G = 4 and 8, head dim 128, bf16, B = 1, all tokens on one rank: the local causal block, the
largest call) at 16K-64K tokens, beyond its inputs q, k, v, dout, written to attention_memory_gqa.*:
- ``--device meta`` (default, any machine): the CUDA path's tensors on the ``meta`` device (the
  sizes the GPU would allocate, no compute), counted by ``_live_bytes.LiveBytes`` at the
  dispatcher; buffers a kernel allocates and frees inside its own call (FlashAttention's float32
  dq accumulator, its dK/dV expanded to H heads under GQA) are not seen;
- ``--device cuda``: ``torch.cuda.max_memory_allocated`` over the call (everything, kernels included).
``--documents`` adds, at the same tokens, the packed-document path (``cu_seqlens``: documents
packed from ProLong's lengths, seed 1, or a heavy-tailed draw where the shared data is absent; the variable-length call with ``flash`` and ``cudnn``, K/V at
G heads) and its peak over the dense path's (the target on a GPU: within 10%).

    python bench/attention_memory.py --gqa                                  # meta, flash and cudnn
    python bench/attention_memory.py --gqa --documents                      # + the packed path
    python bench/attention_memory.py --gqa --documents --device cuda --kernels auto flash --out results/gpu
"""

from __future__ import annotations

import argparse
import random
import resource
import sys
import time

import torch
from _common import document_lengths, pack, write_outputs
from _live_bytes import LiveBytes

from megatron_hexiseq.attention import build_hexiseq_groups, hexiseq_attn_func
from megatron_hexiseq.attention.documents import parse_cu_seqlens
from megatron_hexiseq.attention.hexiseq import group_to_tokens, heads_to_group
from megatron_hexiseq.attention.kernels import Kernel, resolve_kernel
from megatron_hexiseq.attention.subring import subring_attn_func
from megatron_hexiseq.layout import Layout, make_layout
from megatron_hexiseq.testbed.spawn import run_ranks

H, G, D, B = 4, 2, 32, 1


def one_rank(S: int) -> Layout:
    return make_layout(
        seq_length=S,
        num_attention_heads=H,
        num_query_groups=G,
        group_sizes=[1],
        segments=[[(0, S)]],
        heads=[list(range(H))],
    )


def four_ranks(S: int) -> Layout:
    """Groups [2, 1, 1]: group 0 holds [0, S/8) and [3S/4, S) split unevenly over its two ranks
    (heads 3/1), the single-rank groups hold the middle: hidden, prefix and full blocks occur."""
    e = S // 8
    return make_layout(
        seq_length=S,
        num_attention_heads=H,
        num_query_groups=G,
        group_sizes=[2, 1, 1],
        segments=[[(0, e), (6 * e, 7 * e)], [(7 * e, S)], [(e, 3 * e)], [(3 * e, 6 * e)]],
        heads=[[0, 1, 3], [2], list(range(H)), list(range(H))],
    )


def _peak_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _worker(rank: int, world: int, layout: Layout, kernel: str) -> dict:
    groups = build_hexiseq_groups(layout)
    s = layout.ranks[rank].num_tokens
    gen = torch.Generator().manual_seed(rank)
    q = torch.randn(s, B, H, D, generator=gen, requires_grad=True)
    k, v = (torch.randn(s, B, G, D, generator=gen, requires_grad=True) for _ in range(2))
    dout = torch.randn(s, B, H * D, generator=gen)
    before = _peak_kib()
    start = time.perf_counter()
    hexiseq_attn_func(q, k, v, groups=groups, kernel=kernel).backward(dout)
    return {
        "tokens": s,
        "extra_mib": (_peak_kib() - before) / 1024,
        "time_s": time.perf_counter() - start,
    }


GQA_H, GQA_D = 32, 128


def _gqa_layer(
    S: int, G: int, kernel: str, device: torch.device, dtype: torch.dtype, cu: list[int] | None
) -> dict:
    """One layer's attention fwd+bwd on a one-rank layout (packed documents ``cu``, or dense with
    None): peak bytes beyond the inputs."""
    lay = make_layout(
        seq_length=S,
        num_attention_heads=GQA_H,
        num_query_groups=G,
        group_sizes=[1],
        segments=[[(0, S)]],
        heads=[list(range(GQA_H))],
    )
    groups = build_hexiseq_groups(lay)
    if device.type == "meta":
        concrete = Kernel(kernel)
        q, dout = (torch.empty(S, 1, GQA_H, GQA_D, dtype=dtype, device=device) for _ in "qd")
        k, v = (torch.empty(S, 1, G, GQA_D, dtype=dtype, device=device) for _ in "kv")
    else:
        concrete = resolve_kernel(kernel, device=device, dtype=dtype, head_dim=GQA_D)
        gen = torch.Generator(device=device).manual_seed(0)
        q, dout = (
            torch.randn(S, 1, GQA_H, GQA_D, generator=gen, device=device, dtype=dtype) for _ in "qd"
        )
        k, v = (
            torch.randn(S, 1, G, GQA_D, generator=gen, device=device, dtype=dtype) for _ in "kv"
        )
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def layer() -> None:  # what hexiseq_attn_func runs once the kernel is resolved
        qg, kg, vg = heads_to_group(q, k, v, groups=groups)
        docs = None if cu is None else parse_cu_seqlens(cu, seq_length=S, batch=1)
        o = subring_attn_func(
            qg, kg, vg, groups=groups, scale=GQA_D**-0.5, kernel=concrete, documents=docs
        )
        out = group_to_tokens(o, groups=groups, num_heads=GQA_H)
        out.backward(dout.reshape(out.shape))

    start = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        layer()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        with LiveBytes(exclude=(q, k, v, dout)) as m:
            layer()
        peak = m.peak
    return {
        "kernel": concrete.value,
        "peak_bytes": int(peak),
        "time_s": time.perf_counter() - start,
    }


def _gqa_worker(
    rank: int, world: int, seqs, ratios, kernels, device: str, dtype: str, documents: bool
) -> list:
    rows = []
    for kernel in kernels:
        for r in ratios:
            for S in seqs:
                paths = [("dense", None)]
                if documents:
                    paths.append(("documents", pack(document_lengths()[1], S, random.Random(1))))
                dense = None
                for path, cu in paths:
                    res = _gqa_layer(
                        S, GQA_H // r, kernel, torch.device(device), getattr(torch, dtype), cu
                    )
                    kv_bytes = 2 * S * (GQA_H // r) * GQA_D * getattr(torch, dtype).itemsize
                    row = {"path": path, "seq_length": S, "h_over_g": r, "kv_bytes": kv_bytes}
                    row["documents"] = 1 if cu is None else len(cu) - 1
                    rows.append({**row, **res})
                    dense = res["peak_bytes"] if cu is None else dense
                    if cu is not None and dense:
                        rows[-1]["over_dense"] = round(res["peak_bytes"] / dense, 3)
                    print(
                        f"{res['kernel']:9s} {path:9s} H/G={r} S={S:6d}: peak "
                        f"{res['peak_bytes'] / 2**20:9.1f} MiB beyond the inputs "
                        f"(K+V {kv_bytes / 2**20:.0f} MiB)",
                        flush=True,
                    )
    return rows


def main_gqa(a) -> None:
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("attention_memory: --device cuda needs a CUDA GPU")
    seqs = a.seqs if a.seqs_given else [16384, 32768, 65536]
    rows = run_ranks(
        _gqa_worker,
        1,
        seqs,
        a.ratios,
        a.kernels,
        a.device,
        a.dtype,
        a.documents,
        timeout_s=3600,
    )[0]
    for r in rows:
        r["peak_mib"] = round(r["peak_bytes"] / 2**20, 1)
        r["kv_mib"] = round(r["kv_bytes"] / 2**20, 1)
    table = [
        "| kernel | path | documents | H/G | S | K+V MiB | peak MiB beyond inputs | over dense |",
        "|---|---|---|---|---|---|---|---|",
    ] + [
        f"| {r['kernel']} | {r['path']} | {r['documents']} | {r['h_over_g']} | {r['seq_length']} "
        f"| {r['kv_mib']} | {r['peak_mib']} | {r.get('over_dense', '')} |"
        for r in rows
    ]
    write_outputs(
        a.out,
        "attention_memory_gqa",
        data={
            "device": a.device,
            "dtype": a.dtype,
            "heads": GQA_H,
            "head_dim": GQA_D,
            "batch": 1,
            "document_lengths": document_lengths()[0] if a.documents else None,
            "rows": rows,
        },
        title=(
            f"One layer's attention fwd+bwd, peak beyond inputs ({a.device}, {a.dtype}, "
            f"H={GQA_H}, D={GQA_D}, one rank)"
        ),
        table="\n".join(table),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument(
        "--reference-up-to",
        type=int,
        default=8192,
        metavar="S",
        help="run the reference kernel for S up to this (its memory grows like S^2)",
    )
    p.add_argument("--out", default="results/bench")
    p.add_argument("--gqa", action="store_true", help="the GQA study (see the docstring)")
    p.add_argument("--device", default="meta", choices=("meta", "cpu", "cuda"), help="--gqa only")
    p.add_argument("--dtype", default="bfloat16", help="--gqa only")
    p.add_argument("--ratios", type=int, nargs="+", default=[4, 8], help="--gqa: H/G values")
    p.add_argument(
        "--kernels", nargs="+", default=["flash", "cudnn"], help="--gqa: kernels (names)"
    )
    p.add_argument(
        "--documents",
        action="store_true",
        help="--gqa: also the packed-document path at the same tokens (ProLong lengths)",
    )
    a = p.parse_args()
    a.seqs_given = "--seqs" in sys.argv
    if a.gqa:
        main_gqa(a)
        return
    rows = []
    plan = [
        (name, fn, "auto") for name, fn in (("1 rank", one_rank), ("4 ranks [2,1,1]", four_ranks))
    ]
    plan.append(("1 rank", one_rank, "reference"))
    for name, make, kernel in plan:
        for S in a.seqs:
            if kernel == "reference" and S > a.reference_up_to:
                continue
            lay = make(S)
            per_rank = run_ranks(_worker, lay.world_size, lay, kernel, timeout_s=3600)
            top = max(per_rank, key=lambda r: r["extra_mib"])
            rows.append(
                {
                    "layout": name,
                    "kernel": kernel,
                    "seq_length": S,
                    "tokens_of_rank": top["tokens"],
                    "extra_mib": round(top["extra_mib"], 1),
                    "mib_per_1k_tokens": round(1024 * top["extra_mib"] / top["tokens"], 2),
                    "time_s": round(max(r["time_s"] for r in per_rank), 2),
                    "per_rank": per_rank,
                }
            )
            print(
                f"{name:16s} {kernel:9s} S={S:6d}: {top['extra_mib']:8.1f} MiB on the largest rank "
                f"({top['tokens']} tokens), {rows[-1]['time_s']} s",
                flush=True,
            )
    table = [
        "| layout | kernel | S | tokens of that rank | peak extra MiB | MiB per 1K tokens | time s |",
        "|---|---|---|---|---|---|---|",
    ]
    table += [
        f"| {r['layout']} | {r['kernel']} | {r['seq_length']} | {r['tokens_of_rank']} | {r['extra_mib']} | "
        f"{r['mib_per_1k_tokens']} | {r['time_s']} |"
        for r in rows
    ]

    def plot(ax) -> None:
        for key in sorted({(r["layout"], r["kernel"]) for r in rows}):
            pts = [r for r in rows if (r["layout"], r["kernel"]) == key]
            ax.plot(
                [r["seq_length"] for r in pts],
                [max(r["extra_mib"], 0.1) for r in pts],
                "o-",
                label=f"{key[0]}, {key[1]}",
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length S")
        ax.set_ylabel("peak extra memory of the largest rank (MiB)")
        ax.set_title(f"HexiSeq attention fwd+bwd memory (fp32, H={H}, G={G}, D={D})")
        ax.legend()

    write_outputs(
        a.out,
        "attention_memory",
        data={"heads": H, "kv_heads": G, "head_dim": D, "batch": B, "rows": rows},
        title=f"Attention memory vs sequence length (CPU, fp32, H={H}, G={G}, D={D})",
        table="\n".join(table),
        plot=plot,
    )


if __name__ == "__main__":
    main()
