"""Packed documents: attention work, K/V bytes, CPU time and peak memory, document-masked vs full causal.

Micro-batches are packed from ``../shared/data/doc_lengths_prolong.json`` (documents drawn in a
seeded shuffled order until the micro-batch is full; the last one is truncated) and from a
generated heavy-tailed distribution (log-normal body, median 2K, with a Pareto tail of index 1.1
above 16K, capped at 1M), several seeds each.

1. **Counts** (exact, from the schedules every rank derives; no compute): per micro-batch, summed
   over the ranks of a layout, the (query, key) pairs computed x query heads, the K/V bytes received
   by the sub-ring exchange (bf16, forward; backward re-fetches the same and returns as many dK/dV
   bytes) and the kernel calls, from ``attention.counts.rank_counts`` (equal to the runtime's
   ``CommStats``, tested) (a CUDA varlen call counts once per block), with documents
   (``document_schedule``) and without (``build_schedule``). Compared with ``sum(len^2) / S^2``,
   the fraction of causal work a document mask keeps. Blocks = (query block, key block) pairs
   computed = kernel calls on CUDA (one varlen call per block); CPU calls = windows (a loop).
2. **CPU time** of one forward+backward (fp32, ``cpu-flash``, 4 ranks in threads under the
   NCCL-rule simulator of the tests, 1 torch thread), documents vs full causal.
3. **Peak memory** of one forward+backward with documents on one rank at 16K-64K tokens (fresh
   process each; Linux peak RSS reset through ``/proc/self/clear_refs`` right before the call, so
   the figure is the call's own growth over its inputs): MiB per 1K tokens should stay flat (no
   [S, T] tensor). ProLong documents, fp32, H=4, G=2, D=32.

    python bench/varlen_attention.py                    # writes results/bench/varlen_attention.*
    python bench/varlen_attention.py --quick            # small sizes
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch
from _common import heavy_tailed, in_fresh_process, pack, prolong_lengths, write_outputs

from megatron_hexiseq.attention.counts import rank_counts
from megatron_hexiseq.attention.documents import parse_cu_seqlens
from megatron_hexiseq.layout import Layout, make_layout

H, G, D = 8, 2, 128  # counts: a Llama-like head shape


def layout_4(S: int, heads: int = H, kv: int = G) -> Layout:
    """Groups [2, 1, 1], uneven segments and heads (as bench/attention_memory.py)."""
    e = S // 8
    return make_layout(
        seq_length=S,
        num_attention_heads=heads,
        num_query_groups=kv,
        group_sizes=[2, 1, 1],
        segments=[[(0, e), (6 * e, 7 * e)], [(7 * e, S)], [(e, 3 * e)], [(3 * e, 6 * e)]],
        heads=[
            list(range(heads - heads // 4)),
            list(range(heads - heads // 4, heads)),
            list(range(heads)),
            list(range(heads)),
        ],
    )


def layout_8(S: int) -> Layout:
    """Groups [4, 2, 1, 1]: an uneven 8-rank layout of contiguous spans."""
    cuts = [0, S // 10, S // 5, S // 3, S // 2, 3 * S // 5, 3 * S // 4, 7 * S // 8, S]
    segs = [[(cuts[i], cuts[i + 1])] for i in range(8)]
    return make_layout(
        seq_length=S,
        num_attention_heads=H,
        num_query_groups=G,
        group_sizes=[4, 2, 1, 1],
        segments=segs,
        heads=[
            [0, 1],
            [2, 3],
            [4, 5],
            [6, 7],
            [0, 1, 2, 3],
            [4, 5, 6, 7],
            list(range(8)),
            list(range(8)),
        ],
    )


def counts(lay: Layout, bounds: list[int] | None) -> dict[str, int]:
    """Totals over the ranks of ``counts.rank_counts`` (what ``CommStats`` records), bf16, B = 1."""
    docs = parse_cu_seqlens(bounds, seq_length=lay.seq_length, batch=1) if bounds else None
    out = {"pairs": 0, "kv_bytes": 0, "calls": 0, "windows": 0}
    for r in range(lay.world_size):
        kw = dict(documents=docs, head_dim=D, element_bytes=2)
        cuda, cpu = rank_counts(lay, r, varlen=True, **kw), rank_counts(lay, r, **kw)  # type: ignore[arg-type]
        out["pairs"] += sum(cuda.pairs.values())
        out["kv_bytes"] += cuda.received["kv"]
        out["calls"] += sum(cuda.calls.values())
        out["windows"] += sum(cpu.calls.values())
    return out


def count_rows(seqs: list[int], seeds: list[int]) -> list[dict]:
    rows = []
    dists = {"prolong": prolong_lengths()}
    for seed in seeds:
        dists[f"heavy-tail s{seed}"] = heavy_tailed(random.Random(seed), 20000)
    for name, lengths in dists.items():
        for S in seqs:
            for lay_name, lay in (
                ("4 ranks [2,1,1]", layout_4(S)),
                ("8 ranks [4,2,1,1]", layout_8(S)),
            ):
                full = counts(lay, None)
                for seed in seeds if name == "prolong" else [0]:
                    b = pack(lengths, S, random.Random(1000 + seed))
                    doc = counts(lay, b)
                    sq = sum((y - x) ** 2 for x, y in zip(b, b[1:])) / S**2
                    rows.append(
                        dict(
                            dist=name,
                            seed=seed,
                            S=S,
                            layout=lay_name,
                            docs=len(b) - 1,
                            sum_sq_frac=round(sq, 4),
                            pairs_frac=round(doc["pairs"] / full["pairs"], 4),
                            kv_frac=round(doc["kv_bytes"] / max(full["kv_bytes"], 1), 4),
                            kv_MiB_full=round(full["kv_bytes"] / 2**20, 1),
                            kv_MiB_docs=round(doc["kv_bytes"] / 2**20, 1),
                            blocks_full=full["calls"],
                            blocks_docs=doc["calls"],
                            cpu_calls_full=full["windows"],
                            cpu_calls_docs=doc["windows"],
                        )
                    )
    return rows


def cpu_time(S: int, bounds: list[int] | None, repeats: int) -> float:
    """Best of ``repeats`` fwd+bwd on 4 simulated ranks in threads (fp32, cpu-flash)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from nccl_sim import NcclSim

    import megatron_hexiseq.attention.comm as comm
    import megatron_hexiseq.attention.groups as groups_mod
    from megatron_hexiseq.attention import build_hexiseq_groups, hexiseq_attn_func

    torch.set_num_threads(1)
    lay = layout_4(S, heads=4, kv=2)
    best = float("inf")
    for _ in range(repeats):
        sim = NcclSim(4)
        comm.dist, groups_mod.dist = sim, sim

        def fn(r: int) -> float:
            g = build_hexiseq_groups(lay)
            s = lay.ranks[r].num_tokens
            q = torch.randn(s, 1, 4, 32, requires_grad=True)
            k = torch.randn(s, 1, 2, 32, requires_grad=True)
            v = torch.randn(s, 1, 2, 32, requires_grad=True)
            t0 = time.perf_counter()
            out = hexiseq_attn_func(q, k, v, groups=g, kernel="auto", cu_seqlens=bounds)
            out.sum().backward()
            return time.perf_counter() - t0

        best = min(best, max(sim.run(fn)))
    return best


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak_rss_kib() -> int:
    """Reset the peak resident set (Linux: writing 5 to clear_refs) and return the current one, so
    the peak read afterwards is this call's own (the imports' earlier peak no longer hides it)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS")


def _memory_child(S: int, bounds: list[int], q) -> None:
    import torch.distributed as dist

    from megatron_hexiseq.attention import build_hexiseq_groups, hexiseq_attn_func

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29700 + S % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    lay = make_layout(
        seq_length=S,
        num_attention_heads=4,
        num_query_groups=2,
        group_sizes=[1],
        segments=[[(0, S)]],
        heads=[[0, 1, 2, 3]],
    )
    g = build_hexiseq_groups(lay)
    qq = torch.randn(S, 1, 4, 32, requires_grad=True)
    k = torch.randn(S, 1, 2, 32, requires_grad=True)
    v = torch.randn(S, 1, 2, 32, requires_grad=True)
    before = _reset_peak_rss_kib()
    t0 = time.perf_counter()
    out = hexiseq_attn_func(qq, k, v, groups=g, kernel="auto", cu_seqlens=bounds)
    out.sum().backward()
    t = time.perf_counter() - t0
    after = _status_kib("VmHWM")
    dist.destroy_process_group()
    q.put(
        {
            "S": S,
            "docs": len(bounds) - 1,
            "peak_MiB": round((after - before) / 1024, 1),
            "MiB_per_1K": round((after - before) / 1024 / (S / 1024), 2),
            "time_s": round(t, 2),
        }
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--out", default="results/bench")
    a = ap.parse_args()
    seqs = [16384, 65536] if a.quick else [16384, 65536, 262144]
    seeds = [1, 2] if a.quick else [1, 2, 3]
    rows = count_rows(seqs, seeds)
    lengths = prolong_lengths()
    S_t = 2048 if a.quick else 8192
    b_t = pack(lengths, S_t, random.Random(7))
    times = {
        "S": S_t,
        "docs": len(b_t) - 1,
        "full_s": round(cpu_time(S_t, None, 2), 3),
        "docs_s": round(cpu_time(S_t, b_t, 2), 3),
    }
    mem = [
        in_fresh_process(_memory_child, S, pack(lengths, S, random.Random(11)))
        for S in ([4096, 8192] if a.quick else [16384, 32768, 65536])
    ]
    table = [
        "| distribution | seed | S | layout | docs | sum len^2 / S^2 | pairs (docs / full) | "
        "K/V bytes (docs / full) | K/V MiB full -> docs | blocks full -> docs | "
        "CPU calls full -> docs |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        table.append(
            f"| {r['dist']} | {r['seed']} | {r['S']} | {r['layout']} | {r['docs']} | "
            f"{r['sum_sq_frac']} | {r['pairs_frac']} | {r['kv_frac']} | "
            f"{r['kv_MiB_full']} -> {r['kv_MiB_docs']} | {r['blocks_full']} -> {r['blocks_docs']} | "
            f"{r['cpu_calls_full']} -> {r['cpu_calls_docs']} |"
        )
    table += [
        "",
        f"CPU fwd+bwd, 4 ranks [2,1,1] in threads, S={times['S']} ({times['docs']} ProLong "
        f"documents), fp32 cpu-flash, best of 2: full causal {times['full_s']} s, "
        f"document-masked {times['docs_s']} s",
        "",
        "| S | docs | peak extra MiB | MiB per 1K tokens | time s |",
        "|---|---|---|---|---|",
    ]
    table += [
        f"| {m['S']} | {m['docs']} | {m['peak_MiB']} | {m['MiB_per_1K']} | {m['time_s']} |"
        for m in mem
    ]

    def plot(ax) -> None:
        x = [r["sum_sq_frac"] for r in rows]
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8, label="y = x")
        ax.scatter(x, [r["pairs_frac"] for r in rows], s=14, label="attention pairs")
        ax.scatter(x, [r["kv_frac"] for r in rows], s=14, marker="x", label="K/V bytes")
        ax.set_xlabel("sum of squared document lengths / S^2")
        ax.set_ylabel("document-masked / full causal")
        ax.set_title("Packed micro-batches (ProLong, heavy-tailed), 4- and 8-rank layouts")
        ax.legend()

    write_outputs(
        a.out,
        "varlen_attention",
        data={"counts": rows, "cpu_time": times, "memory": mem},
        title="Packed documents: document-masked vs full causal HexiSeq attention",
        table="\n".join(table),
        plot=plot,
    )
    print("\n".join(table))


if __name__ == "__main__":
    main()
