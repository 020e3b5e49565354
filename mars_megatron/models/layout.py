"""Whether an architecture can be split over a parallel layout, and how its layers fall on pipeline stages.

One set of rules for the three places that ask: the model provider before it builds a model, the trainer
before it starts any process, and the planner and launcher (``mars plan``, ``launch/config_fit``) before
they recommend or accept a layout. Were they separate, the planner could recommend a layout the trainer then
refuses. Pure arithmetic on a :class:`~mars_megatron.models.hf_config.Qwen3Arch`: no torch, no GPU.

The rules are Megatron-Core's (``TransformerConfig.__post_init__``, ``transformer_block``,
``ColumnParallelLinear``): tensor parallelism splits the attention heads, the KV groups, every dense MLP and
the padded vocabulary; expert parallelism splits the experts and expert tensor parallelism each expert's MLP;
without ``num_layers_in_first/last_pipeline_stage`` the layers must divide evenly over the stages, and with
them the middle stages must share the rest evenly (at least one layer each).
"""

from __future__ import annotations

from mars_megatron.config import ParallelConfig
from mars_megatron.models.hf_config import Qwen3Arch


class LayoutError(ValueError):
    """A layout that cannot split the model; ``field`` names the ``parallel`` setting at fault."""

    def __init__(self, message: str, field: str) -> None:
        self.message, self.field = message, field
        super().__init__(f"parallel.{field}: {message}")


def stage_layers(num_layers: int, pp: int, first: int | None = None, last: int | None = None) -> list[int]:
    """Layers per pipeline stage under Megatron's rule: the first/last stage counts when given, the rest
    split evenly over the other stages (each keeps at least one layer)."""
    if pp == 1:
        if first is not None or last is not None:
            field = "first_stage_layers" if first is not None else "last_stage_layers"
            raise LayoutError("needs pp > 1", field)
        return [num_layers]
    middle_stages = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if (
        rest < 0
        or (middle_stages == 0 and rest != 0)
        or (middle_stages > 0 and (rest % middle_stages or rest == 0))
    ):
        field = "pp" if first is None and last is None else "first_stage_layers/last_stage_layers"
        raise LayoutError(
            f"{num_layers} layers cannot be split over pp={pp} stages "
            f"(first={first}, last={last}, the other stages must share the rest evenly)",
            field,
        )
    even = rest // middle_stages if middle_stages else 0
    counts = [even] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def balanced_ends(num_layers: int, pp: int) -> tuple[int | None, int | None]:
    """First/last stage layer counts for ``pp`` stages when ``num_layers`` does not divide evenly: the
    smallest ends that keep the middle stages equal, so the first stage (most micro-batches in flight, plus
    the embedding) gets the smaller share. ``(None, None)`` when the layers divide evenly."""
    if pp == 1 or num_layers % pp == 0:
        return None, None
    middle = -(-num_layers // pp)
    rest = num_layers - (pp - 2) * middle
    if rest < 2:
        middle = num_layers // pp
        rest = num_layers - (pp - 2) * middle
    return rest // 2, rest - rest // 2


def check_layout(
    arch: Qwen3Arch,
    *,
    tp: int,
    pp: int,
    ep: int,
    etp: int,
    vocab_pad_multiple: int,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> None:
    """Raise :class:`LayoutError` naming the field when ``arch`` cannot be split this way."""
    heads, kv = arch.num_attention_heads, arch.num_key_value_heads
    if heads % tp:
        raise LayoutError(f"{tp} must divide num_attention_heads ({heads})", "tp")
    if kv % tp:
        raise LayoutError(f"{tp} must divide num_key_value_heads ({kv}): Megatron splits the KV groups", "tp")
    dense = not arch.is_moe or not all(arch.moe_layers)
    if dense and arch.ffn_hidden_size % tp:  # only dense layers build an MLP of intermediate_size
        raise LayoutError(f"{tp} must divide intermediate_size ({arch.ffn_hidden_size})", "tp")
    vocab = arch.padded_vocab_size(vocab_pad_multiple)
    if vocab % tp:
        raise LayoutError(
            f"{tp} must divide the padded vocabulary ({vocab}; see model.vocab_pad_multiple)", "tp"
        )
    if arch.is_moe:
        assert arch.num_experts is not None and arch.moe_ffn_hidden_size is not None
        if arch.num_experts % ep:
            raise LayoutError(f"{ep} must divide num_experts ({arch.num_experts})", "ep")
        if arch.moe_ffn_hidden_size % etp:
            raise LayoutError(f"{etp} must divide moe_intermediate_size ({arch.moe_ffn_hidden_size})", "etp")
    elif ep > 1:
        raise LayoutError(f"{ep} needs a MoE model; {arch.architecture} has no experts", "ep")
    stage_layers(arch.num_layers, pp, first_stage_layers, last_stage_layers)


def check_parallel(arch: Qwen3Arch, parallel: ParallelConfig, vocab_pad_multiple: int) -> None:
    """:func:`check_layout` for a run's ``parallel`` section (``etp`` null resolved to ``tp``)."""
    check_layout(
        arch,
        tp=parallel.tp,
        pp=parallel.pp,
        ep=parallel.ep,
        etp=parallel.effective_etp,
        vocab_pad_multiple=vocab_pad_multiple,
        first_stage_layers=parallel.first_stage_layers,
        last_stage_layers=parallel.last_stage_layers,
    )
