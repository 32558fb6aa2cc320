"""Packed documents: per-micro-batch, document-aware token assignments (``batch``), the baselines
priced in the same document-masked cost model (``schemes``), micro-batch packing and length
distributions (``packing``). docs/varlen.md."""
