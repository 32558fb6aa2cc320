"""Overhead of HexiSeq attention vs plain even Ulysses and plain even zig-zag ring (4 gloo ranks).

Every implementation runs the same problem (full sequence S, batch B, H query heads, G K/V heads,
head dim D, causal, float32, torch's fused CPU SDPA kernel) forward + backward on 4 processes
(1 thread each). Timing: one spawn runs all implementations interleaved round-robin, the order
rotated every round (so drifting load from other work hits them alike); one iteration = barrier, forward, backward, barrier, and its
time is the slowest rank's; we report the median over ``--repeats`` rounds after ``--warmup``.
Memory: a fresh spawn per implementation runs one iteration; we report the largest per-rank growth
of peak resident memory (``ru_maxrss``): an approximation (CPU has no allocator peak counter like
CUDA's). Every implementation's output is checked against single-device attention first.

Implementations: ``ulysses`` (plain, contiguous split), ``ring`` (plain, zig-zag split),
``hexiseq-*`` on even layouts that reproduce them (Ulysses: 1 group of 4; ring: 4 groups of 1 on
the zig-zag split; USP: 2 groups of 2 on the zig-zag split) and on an uneven layout (groups [3, 1],
uneven tokens and heads). Target: HexiSeq on an even layout <= 1.10x the best plain implementation.
``yunchang`` (USP) is not run: it needs flash-attn kernels that do not exist for CPU.

The CPU (2 cores) is shared with other work while this runs: timings are noisy; compare ratios.

    python bench/attention_overhead.py                    # S=4096, writes results/bench/attention_overhead.*
    python bench/attention_overhead.py --seq 1024 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

from megatron_hexiseq.io import write_text_atomic
from megatron_hexiseq.layout import Layout, make_layout, split_evenly, zigzag_segments
from megatron_hexiseq.testbed.spawn import run_ranks

WORLD = 4


def even_layout(S: int, H: int, G: int, group_size: int, zigzag: bool) -> Layout:
    """Even layout: groups of ``group_size``, heads split evenly (contiguous) inside each group."""
    if zigzag:
        segs = zigzag_segments(S, WORLD)
    else:
        segs = [[(r * S // WORLD, (r + 1) * S // WORLD)] for r in range(WORLD)]
    counts = split_evenly(H, group_size)
    heads = [list(range(sum(counts[:i]), sum(counts[: i + 1]))) for i in range(group_size)]
    return make_layout(
        seq_length=S,
        num_attention_heads=H,
        num_query_groups=G,
        group_sizes=[group_size] * (WORLD // group_size),
        segments=segs,
        heads=heads * (WORLD // group_size),
    )


def uneven_layout(S: int, H: int, G: int) -> Layout:
    """Groups [3, 1] on the zig-zag chunks (c = S/8): rank 3 alone holds chunks 3 and 4 with every
    head; ranks 0-2 share chunks 0-2 and 5-7 with uneven token counts (shifted by c/4) and heads
    3/3/2 (for H=8): uneven groups, tokens and heads, roughly balanced work."""
    c, q = S // 8, S // 32
    segs = [
        [(0, c + q), (7 * c, 8 * c)],
        [(c + q, 2 * c), (6 * c - q, 7 * c)],
        [(2 * c, 3 * c), (5 * c, 6 * c - q)],
        [(3 * c, 5 * c)],
    ]
    n = split_evenly(H, 3)
    heads = [
        list(range(0, n[0])),
        list(range(n[0], n[0] + n[1])),
        list(range(n[0] + n[1], H)),
        list(range(H)),
    ]
    return make_layout(
        seq_length=S,
        num_attention_heads=H,
        num_query_groups=G,
        group_sizes=[3, 1],
        segments=segs,
        heads=heads,
    )


def _positions(name: str, rank: int, S: int, lay: Layout | None) -> torch.Tensor:
    if lay is not None:
        return torch.tensor(lay.ranks[rank].positions(), dtype=torch.long)
    if name == "ulysses":
        return torch.arange(rank * S // WORLD, (rank + 1) * S // WORLD)
    c = S // (2 * WORLD)  # ring: zig-zag
    return torch.cat(
        [
            torch.arange(rank * c, (rank + 1) * c),
            torch.arange((2 * WORLD - 1 - rank) * c, (2 * WORLD - rank) * c),
        ]
    )


def _make_step(rank: int, name: str, lay: Layout | None, comm_chunks: int, q, k, v, dout):
    """(shard positions, one fwd+bwd iteration) of one implementation on this rank."""
    from megatron_hexiseq.attention import build_hexiseq_groups, hexiseq_attn_func
    from megatron_hexiseq.attention.ring import ring_attn_func
    from megatron_hexiseq.attention.ulysses import ulysses_attn_func

    S = q.shape[0]
    pos = _positions(name, rank, S, lay)
    ql, kl, vl, dl = (x[pos].clone() for x in (q, k, v, dout))
    if lay is not None:
        groups = build_hexiseq_groups(lay)

        def fn(a, b, c):
            return hexiseq_attn_func(a, b, c, groups=groups, kernel="auto", comm_chunks=comm_chunks)

    elif name == "ulysses":
        fn = lambda a, b, c: ulysses_attn_func(a, b, c, group=dist.group.WORLD)  # noqa: E731
    else:
        fn = lambda a, b, c: ring_attn_func(a, b, c, group=dist.group.WORLD, kernel="auto")  # noqa: E731

    def step() -> torch.Tensor:
        a, b, c = (x.clone().requires_grad_() for x in (ql, kl, vl))
        out = fn(a, b, c)
        out.backward(dl)
        return out.detach()

    return pos, step


def _inputs(cfg: dict):
    gen = torch.Generator().manual_seed(0)
    S, B, H, G, D = cfg["seq"], cfg["batch"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    q, k, v = (torch.randn(S, B, n, D, generator=gen) for n in (H, G, G))
    return q, k, v, torch.randn(S, B, H * D, generator=gen)


def _time_worker(rank: int, world: int, runs: list, cfg: dict) -> dict:
    """All implementations in one spawn, interleaved round-robin (fair under drifting CPU load)."""
    q, k, v, dout = _inputs(cfg)
    full = _full_output(q, k, v)
    steps = {}
    for name, lay, chunks, _ in runs:
        pos, step = _make_step(rank, name, lay, chunks, q, k, v, dout)
        torch.testing.assert_close(
            step(), full[pos], rtol=2e-4, atol=2e-4
        )  # exact vs single device
        steps[name] = step
    times = {name: [] for name in steps}
    names = list(steps)
    for i in range(cfg["warmup"] + cfg["repeats"]):
        for name in (
            names[i % len(names) :] + names[: i % len(names)]
        ):  # rotate: no fixed position in a round
            step = steps[name]
            dist.barrier()
            t0 = time.perf_counter()
            step()
            dist.barrier()
            if i >= cfg["warmup"]:
                times[name].append(time.perf_counter() - t0)
    return times


def _memory_worker(rank: int, world: int, run: tuple, cfg: dict) -> float:
    """Growth of this process's peak resident memory over one iteration (MiB), fresh process."""
    name, lay, chunks, _ = run
    q, k, v, dout = _inputs(cfg)
    _, step = _make_step(rank, name, lay, chunks, q, k, v, dout)
    dist.barrier()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024


def _full_output(q, k, v) -> torch.Tensor:
    """Single-process causal attention (torch SDPA, float32), for the correctness check."""
    H, G = q.shape[2], k.shape[2]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3),
        k.permute(1, 2, 0, 3),
        v.permute(1, 2, 0, 3),
        is_causal=True,
        enable_gqa=H != G,
    )
    return out.permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", default="results/bench")
    a = p.parse_args(argv)
    cfg = {
        "seq": a.seq,
        "batch": a.batch,
        "heads": a.heads,
        "kv_heads": a.kv_heads,
        "head_dim": a.head_dim,
        "repeats": a.repeats,
        "warmup": a.warmup,
    }
    S, H, G = a.seq, a.heads, a.kv_heads
    runs = [
        ("ulysses", None, 1, True),
        ("ring", None, 1, True),
        ("hexiseq-ulysses", even_layout(S, H, G, WORLD, zigzag=False), 1, True),
        ("hexiseq-ring", even_layout(S, H, G, 1, zigzag=True), 1, True),
        ("hexiseq-ring-chunks2", even_layout(S, H, G, 1, zigzag=True), 2, True),
        ("hexiseq-usp2x2", even_layout(S, H, G, 2, zigzag=True), 1, True),
        ("hexiseq-uneven-3+1", uneven_layout(S, H, G), 1, False),
    ]
    times = run_ranks(_time_worker, WORLD, runs, cfg)
    rows = []
    for name, lay, chunks, even in runs:
        per_iter = [max(t[name][i] for t in times) for i in range(a.repeats)]
        mem = run_ranks(_memory_worker, WORLD, (name, lay, chunks, even), cfg)
        rows.append(
            {
                "impl": name,
                "even": even,
                "comm_chunks": chunks,
                "median_s": statistics.median(per_iter),
                "min_s": min(per_iter),
                "times_s": per_iter,
                "peak_rss_growth_mib": max(mem),
            }
        )
        print(f"{name:24s} median {rows[-1]['median_s']:.3f} s", file=sys.stderr)
    best_plain = min(r["median_s"] for r in rows if r["impl"] in ("ulysses", "ring"))
    best_plain_min = min(r["min_s"] for r in rows if r["impl"] in ("ulysses", "ring"))
    for r in rows:
        r["vs_best_plain"] = r["median_s"] / best_plain
        r["min_vs_best_plain"] = r["min_s"] / best_plain_min
    os.makedirs(a.out, exist_ok=True)
    doc = {
        "config": cfg,
        "world_size": WORLD,
        "threads_per_rank": 1,
        "torch": torch.__version__,
        "note": "shared 2-core CPU, gloo; times are the slowest rank per iteration; noisy",
        "rows": rows,
    }
    write_text_atomic(
        os.path.join(a.out, "attention_overhead.json"), json.dumps(doc, indent=2) + "\n"
    )
    md = [
        f"# Attention overhead (4 gloo ranks, S={S}, B={a.batch}, H={H}, G={G}, D={a.head_dim}, fp32, kernel auto)",
        "",
        "| implementation | even | comm_chunks | median fwd+bwd (s) | vs best plain | min (s) | min vs best plain "
        "| peak RSS growth (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        md.append(
            f"| {r['impl']} | {'yes' if r['even'] else 'no'} | {r['comm_chunks']} | {r['median_s']:.3f} | "
            f"{r['vs_best_plain']:.2f}x | {r['min_s']:.3f} | {r['min_vs_best_plain']:.2f}x | {r['peak_rss_growth_mib']:.0f} |"
        )
    md += [
        "",
        f"Median and minimum of {a.repeats} iterations after {a.warmup} warm-up (the minimum is the least "
        "disturbed by other work on the shared CPU). Target: HexiSeq on an even layout <= 1.10x the best plain "
        "implementation.",
    ]
    write_text_atomic(os.path.join(a.out, "attention_overhead.md"), "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
