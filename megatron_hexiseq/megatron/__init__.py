"""Megatron-LM integration (see docs/megatron.md).

``args`` (the ``--hexiseq-*`` flags), ``parallel_state`` (layout checks + ``HexiSeqRuntime``),
``core_attention`` + ``spec`` (``HexiSeqCoreAttention`` in layer specs), ``batch`` (layout slicing),
``rope`` (RoPE at global positions), ``loss`` (per-token loss), ``plugin`` (what ``pretrain_gpt``
calls), ``launch`` (rank placement for SLURM), ``train_cpu`` (CPU training driver),
``reference_attention`` (single-device oracle). Importing this package imports nothing heavy.
"""
