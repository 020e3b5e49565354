"""mars-megatron: MarsRL multi-agent reasoning training on Megatron-Core."""

__version__ = "0.1.0"
