"""megatron-hexiseq: uneven context + head parallelism for Megatron-LM on mixed GPUs."""

from megatron_hexiseq.errors import HexiSeqError

__version__ = "0.1.0"
__all__ = ["HexiSeqError", "__version__"]
