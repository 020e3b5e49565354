"""HF ↔ Megatron weights: the pure name and shard mapping (``qwen3_mapping``), streaming safetensors I/O
(``hf_io``) and a model's weights in and out on every rank (``model_io``: loading, export, the weight
push's walk).

Why a layer below ``training``: the trainer's weight push (``training/weight_sync.py``) walks the same
export as ``mars convert``, so the mapping must not depend on the trainer. Building a Megatron model and
reading or writing its dist checkpoint is the job above ``training``: :mod:`mars_megatron.convert`.
"""
