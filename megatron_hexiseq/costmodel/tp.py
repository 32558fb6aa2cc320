"""Tensor parallelism in the cost model: a TP bundle is one planning unit.

A layout over TP bundles of t GPUs (``layout.tensor_model_parallel_size``,
``megatron_hexiseq.tensor_parallel``) is priced as the same layout on the **bundle problem**: the
cluster with one device per bundle (``bundle_cluster``: each node's ``count / t`` bundles, the GPU
type, memory and per-GPU bandwidths of one of its GPUs) and **one TP rank's model** (``rank_model``:
heads, query groups, FFN and vocabulary divided by t as Megatron splits them), with
``options.tensor_model_parallel_size = t``. Every bundle GPU does the same work at the same time
(its own heads of the bundle's tokens), so one TP rank's time and memory are the bundle's:

- compute: t x the GPU's compute on the bundle's tokens = one GPU on its 1/t of the linear FLOPs
  (``linear_flops_per_token`` of the rank's model) and on its ``H/t`` query heads;
- less the sequence-parallel collectives over NVLink (``formulas.tp_collective_s_per_token``, folded
  into ``linear_s_per_token``: they sit between the linears, in the linear phase);
- weights, gradients and optimizer state divided by t (``static_memory_bytes`` of the rank's model:
  its parameter count; norms stay whole, replicated as in Megatron), sharded over the
  data-parallel x CP ranks of each TP rank (the layout's bundles x D);
- activations as Megatron's TP with sequence parallelism divides them (``activation_bytes_per_token``
  with t: Korthikanti et al. 2022, Sec. 4.2.2), the attention core at the rank's bundle heads, the
  head all-to-all and the K/V exchange between TP-rank-i peers at each GPU's own ports.

``estimate(layout over bundles, real cluster, model, options)`` prices its ``bundle_problem``, so
``simulate``, ``show`` and the planner price a TP layout alike.
"""

from __future__ import annotations

import functools
from dataclasses import replace

from megatron_hexiseq.cluster import Cluster, cluster_of_nodes
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.run_config import TrainOptions
from megatron_hexiseq.tensor_parallel import check_bundle_nodes, tp_heads

VOCAB_DIVISIBLE_BY = 128  # Megatron-LM's --make-vocab-size-divisible-by default

_BUNDLE_CLUSTERS: dict[tuple[int, int], tuple[Cluster, Cluster]] = {}


@functools.lru_cache(maxsize=32)
def rank_model(model: ModelSpec, tp: int) -> ModelSpec:
    """One TP rank's share of ``model`` (``tp`` = 1: ``model`` itself): ``H/t`` query heads,
    ``G/t`` K/V heads (1 with Megatron's replication), ``f/t`` FFN columns, the padded vocabulary's
    ``1/t`` (Megatron pads it to a multiple of 128 x t: ``_vocab_size_with_padding``); hidden size
    and head dim whole. Its FLOP and parameter formulas then count what one GPU of a bundle does
    and holds (the QKV projection with replicated K/V is counted at one K/V head per rank, where
    Megatron computes ``(H + 2G) d / t`` columns: ``G < t`` only)."""
    if tp == 1:
        return model
    heads, groups = tp_heads(model.num_attention_heads, model.num_query_groups, tp)
    if model.ffn_hidden_size % tp:
        raise HexiSeqError(
            f"model {model.name!r}: ffn_hidden_size {model.ffn_hidden_size} does not divide over "
            f"--tensor-model-parallel-size {tp}"
        )
    multiple = VOCAB_DIVISIBLE_BY * tp
    vocab = -(-model.vocab_size // multiple) * multiple // tp
    return replace(
        model,
        name=f"{model.name}/tp{tp}",
        num_attention_heads=heads,
        num_query_groups=groups,
        ffn_hidden_size=model.ffn_hidden_size // tp,
        vocab_size=vocab,
    )


def bundle_cluster(cluster: Cluster, tp: int) -> Cluster:
    """The cluster with one device per TP bundle (``tp`` = 1: ``cluster`` itself): node j keeps
    its name, GPU type, memory and per-GPU bandwidths with ``count / t`` devices; bundle r is
    devices ``r*t .. r*t+t-1`` of ``cluster``. Cached per (cluster, t): the planner asks often."""
    if tp == 1:
        return cluster
    key = (id(cluster), tp)
    got = _BUNDLE_CLUSTERS.get(key)
    if got is not None and got[0] is cluster:
        return got[1]
    check_bundle_nodes([(n.name, n.count) for n in cluster.nodes], tp)
    bundles = cluster_of_nodes(
        cluster.name, [replace(n, count=n.count // tp) for n in cluster.nodes]
    )
    if len(_BUNDLE_CLUSTERS) >= 8:
        _BUNDLE_CLUSTERS.pop(next(iter(_BUNDLE_CLUSTERS)))
    _BUNDLE_CLUSTERS[key] = (cluster, bundles)
    return bundles


def bundle_problem(
    layout: Layout, cluster: Cluster, model: ModelSpec, options: TrainOptions
) -> tuple[Layout, Cluster, ModelSpec, TrainOptions]:
    """What a layout over bundles of t GPUs (``layout.tensor_model_parallel_size``) is priced on:
    the layout as a plain layout of the bundle cluster, the bundle cluster, one TP rank's model and
    the options with t (module docstring). ``estimate`` calls it; ``cluster`` and ``model`` are
    the real ones (``check_matches`` passed)."""
    tp = layout.tensor_model_parallel_size
    b_cluster, b_model, b_options = bundle_setting(cluster, model, options, tp)
    return over_bundles(layout), b_cluster, b_model, b_options


def bundle_setting(
    cluster: Cluster, model: ModelSpec, options: TrainOptions, tp: int
) -> tuple[Cluster, ModelSpec, TrainOptions]:
    """``(bundle cluster, one TP rank's model, options with t)``: what layouts over bundles of
    ``tp`` GPUs are planned on (the planner's and the batch planner's bundle problem)."""
    return (
        bundle_cluster(cluster, tp),
        rank_model(model, tp),
        replace(options, tensor_model_parallel_size=tp),
    )


def over_bundles(layout: Layout) -> Layout:
    """``layout`` (over TP bundles) as a plain layout of the bundle problem (t = 1: the bundle
    cluster's devices are the bundles)."""
    return replace(layout, tensor_model_parallel_size=1)
