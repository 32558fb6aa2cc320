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
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
from _common import write_outputs

from megatron_hexiseq.attention import build_hexiseq_groups, hexiseq_attn_func
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
    a = p.parse_args()
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
