"""Megatron-LM integration (see docs/megatron.md).

``args`` (the ``--hexiseq-*`` flags), ``runtime`` (layout checks + ``HexiSeqRuntime``),
``core_attention`` + ``spec`` (``HexiSeqCoreAttention`` in layer specs), ``batch`` (layout slicing),
``rope`` (RoPE at global positions), ``loss`` (per-token loss), ``plugin`` (what ``pretrain_gpt``
calls), ``launch`` (rank placement for SLURM), ``config`` (``ModelSpec`` -> ``TransformerConfig``,
the CPU device shim), ``reference_attention`` (single-device oracle, pass-through attention).
The CPU training driver lives in :mod:`megatron_hexiseq.testbed.train`. Importing this package imports nothing heavy.
"""
