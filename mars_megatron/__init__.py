"""mars-megatron: MarsRL multi-agent reasoning training on Megatron-Core."""

from mars_megatron import lazy_jit

__version__ = "0.1.0"

lazy_jit.install()  # before anything imports megatron-core (see mars_megatron/lazy_jit.py)
