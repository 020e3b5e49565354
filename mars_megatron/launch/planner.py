"""``mars plan``: which Megatron layouts fit a model on a cluster, and roughly how fast each one is.

Pure arithmetic on a :class:`~mars_megatron.models.hf_config.Qwen3Arch` — no torch, no GPU — so a layout
can be sized before any node is booked. Memory is counted in bytes per GPU for the *worst* pipeline stage;
every term below is what a rank of our trainer (Megatron-Core DDP + distributed optimizer, bf16, Transformer
Engine's layers and flash attention, or Megatron-Core's local layer spec: its own section below) and a
colocated vLLM engine hold. Symbols: ``h`` hidden, ``a``/``g`` query/KV
heads, ``d`` head dim, ``f`` dense FFN, ``E``/``k``/``f_e`` experts, top-k and expert FFN, ``V`` vocabulary
padded to a multiple of 128 (as the trainer pads it), ``b`` micro-batch, ``s`` packed sequence length.
The preset models are the HF config.json files shipped in ``mars_megatron/launch/hf_configs/<name>/``
(package data; ``examples/hf_configs`` links to them), so a preset and a recipe's ``model.hf_dir`` cannot
disagree.

Layout (Megatron semantics): world = tp·pp·cp·dp; the tp·cp·dp ranks of a stage are regrouped as
etp·ep·edp for the experts, so edp = tp·cp·dp / (ep·etp) must be a whole number. Megatron splits query
heads *and* KV groups over tp (``divide(num_query_groups, tp)``), so tp must divide the KV heads; vLLM
instead replicates KV heads when its tp exceeds them. Sequence parallelism is on whenever tp > 1.

Parameters of a rank (``P_dense``: attention q/k/v/o and dense MLPs split over tp, norms and routers
replicated, the embedding on the first stage and the output layer on the last, each V·h/tp; ``P_exp``:
routed experts, E·3·h·f_e per MoE layer split over ep·etp):

* weights   = 2 B · (P_dense + P_exp)                                  bf16 parameters
* grads     = 4 B · (P_dense + P_exp)                                  fp32 main grads: the trainer sets
  ``grad_reduce_in_fp32=True`` (Megatron-LM does the same for bf16; the dataclass default is False).
  The grad buffer is not sharded (the distributed optimizer is ZeRO-1: it reduce-scatters into it).
* optimizer = 12 B · (P_dense / (dp·cp) + P_exp / edp)                 fp32 master weights + Adam m, v,
  sharded by the distributed optimizer over the data-parallel group (with cp) and, for experts, over the
  expert-data-parallel group. Without it: 12 B · (P_dense + P_exp). (Megatron's table: 6 + 12/d B/param.)
* FP8 (``fp8``, the trainer's ``model.fp8``: hybrid, e4m3 or blockwise) keeps bf16 parameters — Transformer
  Engine quantizes them for each GEMM, these are not FP8 primary weights — so weights, grads and optimizer
  stay as above, plus TE's FP8 copies of the weights it quantizes, ``P_lin``: attention q/k/v/o, dense MLPs
  and experts (not the embedding, the output layer, routers or norms, which run in bf16). A Hopper FP8 GEMM
  reads both operands K-major, so the backward's dgrad GEMM needs the weight transposed: TE keeps the
  row-wise copy (forward) and the column-wise, physically transposed one (dgrad). Megatron passes
  ``is_first_microbatch`` (``disable_parameter_transpose_cache`` is False), so TE caches both across
  micro-batches, re-quantized on each step's first: weights += 2 B · P_lin. The same for blockwise: its
  weights are quantized in 128×128 tiles, and the transposed copy is the same tiles transposed (one fp32
  scale per tile, 0.02 %, is left out). With a KL reference (:mod:`.config_fit`) the reference only runs
  forward without grad, so TE caches only its row-wise copy, 1 B · P_lin.

Activations per layer and micro-batch, after Korthikanti et al. 2022 ("Reducing Activation Recomputation
in Large Transformer Models", 34·s·b·h + 5·a·s²·b per layer, all over t with sequence parallelism),
re-derived for Qwen3: RMSNorm, no dropout (so no masks), GQA with q/k-norm, SwiGLU, top-k MoE. With
``s_r = s/cp`` tokens of a rank's context slice and ``s_h = s_r/tp`` of them in the sequence-parallel
region, ``a_r = a/tp``, ``g_r = g/tp``:

* attention = 4·b·s_h·h  (input-norm input, QKV-linear input)
  + 6·b·s_r·d·(a_r + g_r)  (the fused QKV output that the q/k norms keep, the normed and rotated q and k,
  and the attention output O = output-projection input, all 2 bytes)
  With flash attention (the default, TE's fused attention) that is all: flash never stores the scores, so
  selective recompute, which drops exactly what follows, saves nothing and is not proposed. Flash's fp32
  log-sum-exp (4·b·s_r·a_r) is left out: under 2 % of O.
* MoE MLP = 4·b·s_h·h (pre-MLP norm input, router/dispatcher input) + 4·b·s_h·E (fp32 router probs)
  + 4·k·b·s_h·etp·h (permuted expert inputs, and expert outputs kept for the probability-weighted combine)
  + 6·k·b·s_h·f_e (SwiGLU input 2·f_e wide and output). Routing is assumed balanced (each rank processes
  k·s_h tokens); real routers are not, which is one reason for the fixed overhead below.
* dense MLP = 4·b·s_h·h + 6·b·s_r·f/tp.
* full recompute keeps only each layer's input, 2·b·s_h·h, plus one layer's full set while it is recomputed.
* the first stage holds pp micro-batches in flight under 1F1B (stage i: min(pp − i, micro-batches)).
* the last stage adds the final-norm and output-layer inputs, 4·b·s_h·h, and the logits/loss buffer
  b·s_r·V/tp · 4 B (``logits_bytes``: training/logprobs.py keeps the bf16 logits for backward and writes
  their bf16 gradient, working through fp32 temporaries in chunks of 1024 tokens).
* FP8 changes only the inputs of the GEMMs TE quantizes: TE saves them for the weight-gradient GEMM in FP8,
  ``q`` bytes an element instead of 2 (q = 1 for hybrid and e4m3, which scale per tensor; for blockwise,
  1 + 4/128: activations are quantized in 1×128 blocks, one fp32 scale per block). Under sequence
  parallelism TE keeps the FP8 local shard and gathers it again in the backward. So, with everything else
  as above:

  - attention: QKV-linear input (TE's fused norm + linear writes the norm output in FP8) 4·b·s_h·h →
    (2 + q)·b·s_h·h; the attention output O stays in bf16 (flash attention saves it for its own backward)
    and the output projection saves an FP8 copy of its input: **+** q·b·s_r·d·a_r.
  - MoE MLP: permuted expert inputs (fc1 input) 4·k·b·s_h·etp·h → (2 + q)·k·b·s_h·etp·h (the expert outputs
    kept for the combine stay bf16); SwiGLU output (fc2 input) 6·k·b·s_h·f_e → (4 + q)·k·b·s_h·f_e (the
    SwiGLU input stays bf16: Megatron's ``activation_func_fp8_input_store`` is off).
  - dense MLP: (2 + q)·b·s_h·h + (4 + q)·b·s_r·f/tp (fc1 input, fused with the pre-MLP norm; fc2 input).
  - unchanged: norm inputs, the router's input and fp32 probs (Megatron's router GEMM is not TE's), the
    QKV output, q/k norms, rotated q and k, softmax scores, full recompute's layer inputs, the final-norm
    and output-layer inputs and the logits (the output layer is Megatron's bf16 ColumnParallelLinear).

  With fp8 the tokens of a micro-batch and rank, s/(cp·tp), must be a multiple of 16 (the FP8 GEMM
  alignment the trainer checks, ``config.FP8_ALIGNMENT``).

Megatron-Core's local layer spec (``Workload.transformer_impl="local"``, ``mars plan --transformer-impl
local`` or its alias ``--no-flash-attention``; the trainer's ``model.transformer_impl=local``, e.g. on a
GPU without Transformer Engine) runs plain torch and Megatron modules, and they keep more than TE's fused
ones. The terms below replace the per-layer ones above; each was measured with saved-tensor hooks on the
trainer's own model (tests/test_planner.py: bf16 and fp32, dense and MoE, with and without selective
recompute, GQA with one or more KV heads and MHA, both router softmaxes, with and without aux loss, the
final norm) and matches to the byte; that runs on one rank, so their tp/cp/ep scaling follows Megatron's
code (checked by hand). ``e`` is the activation element (2 B in bf16, 4 in fp32: the planner plans bf16,
the CPU tests run fp32 too); :func:`local_attention_bytes`, :func:`local_mlp_bytes`,
:func:`final_norm_bytes`:

* each RMSNorm of the layer (ours, with HF's numerics: statistics in fp32) keeps an fp32 copy of its input
  (in fp32, the input itself), the normalised input and the output that the next linear saves, e bytes
  each, and one fp32 rsqrt per row: (4 + 2·e)·b·s_h·h + 4·b·s_h, twice per layer; the same for the last
  stage's final norm, whose output the output layer saves (in place of 4·b·s_h·h).
* attention: the q and k norms keep their rows' fp32 input 4·b·s_r·d·(a_r + g_r), normalised rows
  e·b·s_r·d·(a_r + g_r) and rsqrt 4·b·s_r·(a_r + g_r); RoPE keeps its cos and sin for q and for k,
  4·e·s_r·d (one position table for the micro-batch, not per sample); the baddbmm keeps the rotated q,
  e·b·s_r·a_r·d, and K as the PV matmul keeps V: GQA repeats them to a_r heads (when a_r > g_r) and the CP
  attention all-gathers them to s tokens, e·b·s·d·n_kv each with n_kv = a_r if a_r > g_r else g_r, V
  only where it is a new tensor (a_r > g_r or cp > 1); the scores c·b·a_r·s_r·s with c bytes per element
  (:func:`local_score_bytes`: the trainer keeps ``attention_softmax_in_fp32`` and turns
  ``masked_softmax_fusion`` off, so the torch softmax keeps its fp32 output and the PV matmul the bf16
  probabilities, c = 6; fp32 training keeps one fp32 tensor, c = 4; baddbmm's raw scores are not kept);
  the output projection's input O, e·b·s_r·a_r·d. The fused QKV output, e·b·s_r·d·(a_r + 2·g_r), is kept
  only through views of it: V where it is no new tensor, and in fp32 the k norm's input (``k.float()`` of
  a view is the view; q's too where g_r = 1, the one case in which Megatron's query reshape is a view),
  which then replaces the norm's fp32 copies (k's always, q's where g_r = 1). Attention dropout is 0.
* selective recompute drops the core attention and keeps its checkpoint's inputs instead: q as above, the
  rotated k (e·b·s_r·g_r·d, before any CP gather), V, a view of the fused QKV output (so that is kept), and
  the mask type as a 4-byte tensor.
* dense MLP: the pre-MLP norm and the unfused SwiGLU: fc1's output (2·f/tp wide, which SiLU keeps), SiLU's
  output, the up half plus Megatron's ``glu_linear_offset`` (0, still a new tensor) and their product
  (fc2's input): 5·e·b·s_r·f/tp.
* MoE MLP: the pre-MLP norm; the router (fp32 scores, with b·s_h tokens of its own): top-k indices 8·k
  and fp32 probabilities, a softmax over the k chosen logits (4·k, HF's ``norm_topk_prob``) or over all E
  (4·E); with an aux loss (``router_aux_loss_coef`` > 0) its fp32 softmax over E per token, and per layer
  its int64 tokens per expert and the loss, 8·E + 4; the all-gather dispatcher (the trainer's default,
  ``parallel.moe_token_dispatcher``) over its N = b·s_h·etp·ep gathered tokens: the local experts'
  routing map and fp32 probabilities, 5·(E/ep)·N, and per routed token (R = k·b·s_h·etp, balanced as
  above) the int64 sort index, the fp32 probability and the permuted token, 12 + e·h; the experts
  (Megatron's ``SequentialMLP``, the local spec's) per routed token: the SwiGLU terms above plus the
  product scaled by the probability (fc2's input), 6·e·f_e/etp.
* full recompute as above: each layer's input, plus one layer's set (this one) while it is recomputed
  (derived, not measured).

Per micro-batch in flight, whatever the recompute: the pack's block-causal mask, b·s_r·s booleans shared
by every layer (the in-place masked fill, or the recompute checkpoint, keeps it). Per rank, once:
Megatron's global "mpu" buffer, which baddbmm's preallocated scores (2·b·a_r·s_r·s in bf16) share with the
sequence-parallel all-gathers (2·b·s_r·h) and the MoE dispatcher's (2·N·h): the largest, reused by every
layer and never freed (:func:`local_score_buffer_bytes`). Left out: the embedding's int64 token indices
(8·b·s_r on the first stage). One layer's transients (the raw bf16 scores and their fp32 copy in the
forward, the fp32 gradients in the backward: up to 6·b·a_r·s_r·s bytes beyond what the layer keeps) are
left to the fixed overhead. On the last stage they come after the loss has released the logits buffer and
stay below it while 6·a_r·s < 4·V/tp (the device check's models: 8 heads, Qwen3's vocabulary, packs up to
8k); beyond that, and on the other stages, they add to the peak. FP8 needs Transformer Engine: a local
workload with ``fp8`` is refused (the trainer's config refuses it too).

Rollout (colocated engines, one per ``rollout.tp`` GPUs): vLLM weights 2 B · params / rollout_tp, and the
KV cache 2 (K, V) · layers · max(1, g / rollout_tp) · d · 2 B per token, times ``max_seqs · seq_len`` tokens
the engine must hold at once. With ``Rollout.fp8`` (vLLM's online ``quantization="fp8"``, which the rollout
engine uses whenever ``model.fp8`` is set) the linear layers and fused experts hold 1 B per parameter and
the rest (embedding, lm_head, router gate, norms) stays bf16: (1 B · P_lin + 2 B · (params − P_lin)) /
rollout_tp over the whole model; the KV cache stays bf16 (no ``kv_cache_dtype`` is set).
Our colocated engines sleep (level 2: weights and KV cache freed; the trainer pushes fresh weights on
wake) while the trainer steps, and the trainer keeps its
weights (FP8 copies included), grads and optimizer state on the GPU while the engines roll out, so the
colocated peak is ``max(train, resident trainer state + rollout)``, not the sum of everything; with
``trainer_offload`` (NeMo-RL offloads the policy during generation) the rollout phase is the engine alone.
A fixed ``overhead_gib`` (default 4 GiB: CUDA context, NCCL buffers, allocator fragmentation, the vLLM
engine's own workspace) is added to every GPU.

Cost (a heuristic that only has to rank layouts): the step's training FLOPs — 6·(active matmul params)
per token plus attention 6·a·d·s per layer and token (causal over the whole pack: an upper bound, since
packed documents attend only within themselves), plus one more forward with full recompute — over
``gpus · peak_flops``, stretched by the 1F1B bubble (m + pp − 1)/m for m micro-batches per pipeline, plus
un-overlapped communication at NVLink or network bandwidth depending on whether the group fits in a node:
sequence-parallel all-gathers/reduce-scatters (8 per layer and micro-batch), MoE all-to-alls (4 per MoE
layer), context-parallel KV exchange, pipeline sends and the data-parallel grad reduce-scatter and param
all-gather. :class:`CostModel` holds the constants. Rollout time is not modelled, nor are FP8's faster
GEMMs: the cost only ranks layouts of one workload.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace
from fractions import Fraction
from importlib import resources
from pathlib import Path
from typing import Literal, get_args

from mars_megatron.config import FP8_ALIGNMENT, ConfigError
from mars_megatron.models import layout as layout_rules
from mars_megatron.models.hf_config import Qwen3Arch, load_hf_config, parse_hf_config
from mars_megatron.training.fp8 import Fp8Mode

GIB = 2**30
Recompute = Literal["none", "selective", "full"]
RECOMPUTE: tuple[Recompute, ...] = ("none", "selective", "full")
TransformerImpl = Literal["transformer_engine", "local"]
TRANSFORMER_IMPLS: tuple[TransformerImpl, ...] = get_args(TransformerImpl)
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # activation dtypes of the local-spec formulas
FP8_MODES: tuple[Fp8Mode, ...] = get_args(Fp8Mode)
FP8_WEIGHT_COPIES = 2  # bytes per quantized weight: TE's row-wise FP8 copy and its transpose (Hopper)
VOCAB_PAD_MULTIPLE = 128  # the trainer's model.vocab_pad_multiple default
PRESET_PACKAGE = "mars_megatron.launch"  # holds hf_configs/<preset>/config.json as package data


class PlanError(ConfigError):
    """A layout or planner input that cannot work; ``path`` names the field (``tp``, ``gpus``, ...)."""


def _load_presets() -> dict[str, Qwen3Arch]:
    """Every ``hf_configs/<name>/config.json`` shipped in the package, by name: the one copy of these
    numbers (examples/hf_configs links to the same files), read through importlib.resources so that an
    installed package finds them too, provided its build lists them as package data."""
    presets: dict[str, Qwen3Arch] = {}
    root = resources.files(PRESET_PACKAGE) / "hf_configs"
    if not root.is_dir():  # an install without the package data: HF directories still work
        return presets
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        config = entry / "config.json"
        if config.is_file():
            source = f"{PRESET_PACKAGE}/hf_configs/{entry.name}/config.json"
            presets[entry.name] = parse_hf_config(json.loads(config.read_text()), source)
    return presets


PRESETS: dict[str, Qwen3Arch] = _load_presets()


def resolve_model(model: str) -> Qwen3Arch:
    """A preset name or an HF checkpoint directory (its config.json) -> the architecture."""
    if model in PRESETS:
        return PRESETS[model]
    if Path(model).exists():
        return load_hf_config(model)
    names = ", ".join(PRESETS) or f"none installed: {PRESET_PACKAGE} lacks its hf_configs package data"
    raise PlanError(f"{model!r} is neither a preset ({names}) nor an HF directory", "model")


# --------------------------------------------------------------------------------------------- params
@dataclass(frozen=True)
class ParamCounts:
    """Parameters by how Megatron shards them (HF vocabulary, so totals match the published counts)."""

    attention: int  # per layer, split over tp: q, k, v, o (+ biases)
    norms: int  # per layer, replicated: input and pre-MLP RMSNorm, q/k norms
    dense_mlp: int  # per dense layer, split over tp: 3·h·f
    router: int  # per MoE layer, replicated: h·E
    experts: int  # per MoE layer, split over ep·etp: E·3·h·f_e
    expert_active: int  # per MoE layer, the k experts one token uses
    embedding: int
    output: int  # 0 when tied to the embedding
    final_norm: int
    moe_layers: tuple[bool, ...]

    def _layer(self, moe: bool, active: bool) -> int:
        mlp = (self.router + (self.expert_active if active else self.experts)) if moe else self.dense_mlp
        return self.attention + self.norms + mlp

    @property
    def total(self) -> int:
        layers = sum(self._layer(moe, False) for moe in self.moe_layers)
        return layers + self.embedding + self.output + self.final_norm

    @property
    def active(self) -> int:
        """Parameters one token touches (embedding row included, as the published "A3B"/"A22B" count)."""
        layers = sum(self._layer(moe, True) for moe in self.moe_layers)
        return layers + self.embedding + self.output + self.final_norm

    @property
    def linear(self) -> int:
        """The weights FP8 quantizes (``P_lin``: q/k/v/o, dense MLPs, experts), in Megatron's TE modules and
        in vLLM alike; the embedding, output layer, routers and norms stay bf16."""
        return sum(self.attention + (self.experts if moe else self.dense_mlp) for moe in self.moe_layers)

    @property
    def matmul_active(self) -> int:
        """Active parameters that take part in a matmul: the FLOPs count (no embedding lookup, no norms)."""
        layers = sum(self._layer(moe, True) - self.norms for moe in self.moe_layers)
        return layers + (self.output or self.embedding)


def param_counts(arch: Qwen3Arch, vocab: int | None = None) -> ParamCounts:
    """Parameter counts of ``arch``; ``vocab`` overrides the vocabulary (the padded one, for memory)."""
    h, d, a, g = arch.hidden_size, arch.head_dim, arch.num_attention_heads, arch.num_key_value_heads
    v = arch.vocab_size if vocab is None else vocab
    attention = h * a * d + 2 * h * g * d + a * d * h + ((a + 2 * g) * d if arch.attention_bias else 0)
    experts = arch.num_experts or 0
    moe_ffn = arch.moe_ffn_hidden_size or 0
    return ParamCounts(
        attention=attention,
        norms=2 * h + 2 * d,
        dense_mlp=3 * h * arch.ffn_hidden_size,
        router=h * experts,
        experts=experts * 3 * h * moe_ffn,
        expert_active=(arch.moe_topk or 0) * 3 * h * moe_ffn,
        embedding=v * h,
        output=0 if arch.tie_word_embeddings else v * h,
        final_norm=h,
        moe_layers=arch.moe_layers if arch.is_moe else (False,) * arch.num_layers,
    )


# --------------------------------------------------------------------------------------------- inputs
def _check_positive(obj: object, names: Sequence[str]) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"must be a positive int, got {value!r}", name)


@dataclass(frozen=True)
class Layout:
    """A Megatron parallel layout. ``etp`` None = tp (Megatron's default); first/last stage layers None =
    spread as evenly as Megatron can express (:func:`stage_layers`)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    dp: int = 1
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    def __post_init__(self) -> None:
        _check_positive(self, [f.name for f in fields(self)])

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: replicas of each expert shard (valid layouts divide exactly)."""
        return self.tp * self.cp * self.dp // (self.ep * self.expert_tp)

    def label(self) -> str:
        return f"tp={self.tp},pp={self.pp},cp={self.cp},ep={self.ep},etp={self.expert_tp},dp={self.dp}"


@dataclass(frozen=True)
class Workload:
    """What one training step processes, and how the trainer stores it."""

    seq_len: int = 32768  # packed sequence length (the trainer's pack_length)
    micro_batch: int = 1  # packed sequences per micro-batch
    global_batch: int = 64  # packed sequences per optimizer step, over all data-parallel ranks
    recompute: Recompute = "none"
    # the trainer's model.transformer_impl as a GPU resolves it: "local" = Megatron-Core's local layer spec
    # (no Transformer Engine: unfused attention that materialises the scores, unfused norms and SwiGLU)
    transformer_impl: TransformerImpl = "transformer_engine"
    logits_bytes: float = 4.0  # bytes per (token, vocab entry) at the loss; see the module docstring
    grad_bytes: int = 4  # main-grad dtype: 4 = fp32 (grad_reduce_in_fp32), 2 = bf16
    distributed_optimizer: bool = True
    fp8: Fp8Mode | None = None  # the trainer's model.fp8: TE's FP8 GEMMs on bf16 parameters

    def __post_init__(self) -> None:
        _check_positive(self, ["seq_len", "micro_batch", "global_batch", "grad_bytes"])
        if self.recompute not in RECOMPUTE:
            raise PlanError(f"must be one of {RECOMPUTE}, got {self.recompute!r}", "recompute")
        if self.fp8 is not None and self.fp8 not in FP8_MODES:
            raise PlanError(f"must be one of {FP8_MODES} or None, got {self.fp8!r}", "fp8")
        if self.transformer_impl not in TRANSFORMER_IMPLS:
            raise PlanError(
                f"must be one of {TRANSFORMER_IMPLS}, got {self.transformer_impl!r}", "transformer_impl"
            )
        if self.fp8 is not None and self.transformer_impl == "local":
            raise PlanError(f"{self.fp8!r} needs Transformer Engine, but transformer_impl is 'local'", "fp8")
        if not self.logits_bytes >= 0:
            raise PlanError(f"must be >= 0, got {self.logits_bytes!r}", "logits_bytes")

    @property
    def flash_attention(self) -> bool:
        """Whether attention is TE's fused (flash) attention: Transformer Engine's layers always run it, and
        the local spec never does (its ``DotProductAttention`` materialises the scores)."""
        return self.transformer_impl == "transformer_engine"


@dataclass(frozen=True)
class Rollout:
    """Colocated vLLM engines; ``colocated=False`` puts them on other GPUs (not counted here)."""

    colocated: bool = True
    tp: int | None = None  # GPUs per engine; None = the smallest that fits (:func:`plan`)
    max_seqs: int = 16  # sequences an engine holds at once
    seq_len: int = 32768  # tokens per sequence (prompt + response)
    trainer_offload: bool = False  # trainer state leaves the GPU while engines roll out (ours does not)
    max_auto_tp: int = 16  # largest engine tried when tp is None (NeMo-RL's 235B GRPO recipes use 16)
    fp8: bool = False  # vLLM's quantization="fp8", which the engine uses whenever model.fp8 is set

    def __post_init__(self) -> None:
        _check_positive(self, ["tp", "max_seqs", "seq_len", "max_auto_tp"])


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int = 8
    gpu_mem_gib: float = 80.0
    overhead_gib: float = 4.0  # CUDA context + NCCL buffers + fragmentation, per GPU

    def __post_init__(self) -> None:
        _check_positive(self, ["gpus", "gpus_per_node"])
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise PlanError(
                f"{self.gpus} GPUs span nodes but are not a multiple of gpus_per_node ({self.gpus_per_node})",
                "gpus",
            )
        for name, least in (("gpu_mem_gib", 1e-9), ("overhead_gib", 0.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < least:
                raise PlanError(f"must be a number >= {least:g}, got {value!r}", name)


# ----------------------------------------------------------------------------------------- validation
def check_layout(arch: Qwen3Arch, layout: Layout, gpus: int, seq_len: int, *, fp8: bool = False) -> None:
    """Megatron's rules for running ``arch`` with ``layout`` on ``gpus`` (and, with ``fp8``, the FP8 GEMM
    alignment the trainer checks at config load); the error names the field."""
    tp, pp, cp, ep, etp = layout.tp, layout.pp, layout.cp, layout.ep, layout.expert_tp
    if layout.world != gpus:
        raise PlanError(f"tp*pp*cp*dp = {tp}*{pp}*{cp}*{layout.dp} = {layout.world} != {gpus} GPUs", "gpus")
    try:  # the rules the trainer's model provider applies (one module: the planner cannot disagree)
        layout_rules.check_layout(
            arch,
            tp=tp,
            pp=pp,
            ep=ep,
            etp=etp,
            vocab_pad_multiple=VOCAB_PAD_MULTIPLE,
            first_stage_layers=layout.first_stage_layers,
            last_stage_layers=layout.last_stage_layers,
        )
    except layout_rules.LayoutError as e:
        raise PlanError(e.message, e.field.split("/")[0]) from None
    if arch.is_moe:
        if ep == 1 and etp != tp:
            raise PlanError(f"must equal tp ({tp}) when ep = 1 (Megatron treats experts as dense)", "etp")
        if (tp * cp * layout.dp) % (ep * etp):
            raise PlanError(
                f"tp*cp*dp = {tp * cp * layout.dp} ranks per stage not divisible by ep*etp = {ep * etp}", "ep"
            )
    if cp > 1 and seq_len % (2 * cp * tp):
        raise PlanError(f"{seq_len} not divisible by 2*cp*tp = {2 * cp * tp} (load-balanced CP)", "seq_len")
    if seq_len % tp:
        raise PlanError(f"{seq_len} not divisible by tp = {tp} (sequence parallelism)", "seq_len")
    if fp8 and (seq_len // (cp * tp)) % FP8_ALIGNMENT:
        raise PlanError(
            f"{seq_len} gives {seq_len // (cp * tp)} tokens per micro-batch and rank (s/(cp*tp)); FP8 "
            f"needs a multiple of {FP8_ALIGNMENT}",
            "seq_len",
        )


def _moe_layers(arch: Qwen3Arch) -> tuple[bool, ...]:
    return arch.moe_layers if arch.is_moe else (False,) * arch.num_layers


def stage_layers(arch: Qwen3Arch, layout: Layout) -> tuple[int, ...]:
    """Layers per pipeline stage of a valid layout (:func:`mars_megatron.models.layout.stage_layers`)."""
    split = layout_rules.stage_layers(
        arch.num_layers, layout.pp, layout.first_stage_layers, layout.last_stage_layers
    )
    return tuple(split)


# --------------------------------------------------------------------------------------------- memory
@dataclass(frozen=True)
class Memory:
    """Bytes on one GPU of the worst pipeline stage (``stage``)."""

    stage: int
    weights: int
    grads: int
    optimizer: int
    activations: int
    logits: int
    rollout_weights: int
    kv_cache: int
    overhead: int
    colocated: bool
    trainer_offload: bool = False
    fp8_weight_cache: int = 0  # the part of ``weights`` that is TE's FP8 weight copies (0 in bf16)

    @property
    def train(self) -> int:
        """The trainer's peak: its state plus one step's activations (engines asleep)."""
        return self.weights + self.grads + self.optimizer + self.activations + self.logits

    @property
    def rollout(self) -> int:
        """The rollout phase: engine weights and KV cache, on top of the resident trainer state."""
        if not self.colocated:
            return 0
        resident = 0 if self.trainer_offload else self.weights + self.grads + self.optimizer
        return resident + self.rollout_weights + self.kv_cache

    @property
    def total(self) -> int:
        return self.overhead + max(self.train, self.rollout)


def gemm_input_bytes(fp8: Fp8Mode | None) -> Fraction:
    """Bytes per element of a GEMM input saved for the backward: bf16, or TE's FP8 copy, which for blockwise
    carries one fp32 scale per 1×128 block."""
    if fp8 is None:
        return Fraction(2)
    return Fraction(1) + (Fraction(4, 128) if fp8 == "blockwise" else 0)


LOCAL_SOFTMAX_IN_FP32 = True  # attention_softmax_in_fp32: TransformerConfig's default, kept by the trainer
LOCAL_SOFTMAX_FUSION = False  # masked_softmax_fusion: the trainer's model provider sets it False


def local_score_bytes(
    dtype: str = "bfloat16",
    *,
    softmax_in_fp32: bool = LOCAL_SOFTMAX_IN_FP32,
    fused: bool = LOCAL_SOFTMAX_FUSION,
) -> int:
    """Bytes per attention-score element that Megatron-Core's local ``DotProductAttention`` keeps for its
    backward, by the activation ``dtype`` and its ``FusedScaleMaskSoftmax`` settings (the defaults: the
    trainer's). Unfused with an fp32 softmax on 16-bit scores (``softmax_in_fp32``): the softmax keeps its
    fp32 output, the PV matmul the 16-bit probabilities, 4 + 2. Unfused otherwise the softmax output and
    the probabilities are one tensor in the activation dtype (fp32: 4, 16-bit: 2). ``fused``: Megatron's
    CUDA softmax kernels (``masked_softmax_fusion``, 16-bit only, up to 4096 keys) keep one 16-bit result
    that the PV matmul reuses: 2."""
    element = _element_bytes(dtype)
    if element == 4 or fused or not softmax_in_fp32:
        return element
    return 4 + element


def _element_bytes(dtype: str) -> int:
    if dtype not in ELEMENT_BYTES:
        raise PlanError(f"must be one of {tuple(ELEMENT_BYTES)}, got {dtype!r}", "dtype")
    return ELEMENT_BYTES[dtype]


def _local_norm_bytes(rows: int, width: int, e: int) -> int:
    """Our RMSNorm (training/model_provider.py) over ``rows`` rows of ``width``: the fp32 copy of its input,
    the normalised input and its output (saved by the next linear), e bytes each, and one fp32 rsqrt a row."""
    return (4 + 2 * e) * rows * width + 4 * rows


def local_attention_bytes(arch: Qwen3Arch, layout: Layout, work: Workload, dtype: str = "bfloat16") -> int:
    """The attention half of one local-spec layer (input norm to output projection) for backward, per
    micro-batch, in activations of ``dtype``: the module docstring's local-spec terms. The pack's mask and
    Megatron's "mpu" buffer are counted once, by :func:`memory`."""
    e = _element_bytes(dtype)
    b, s, t, cp = work.micro_batch, work.seq_len, layout.tp, layout.cp
    s_r = s // cp
    s_h = s_r // t
    h, d = arch.hidden_size, arch.head_dim
    a_r, g_r = arch.num_attention_heads // t, arch.num_key_value_heads // t
    selective = work.recompute == "selective"
    kv_new = a_r > g_r or cp > 1  # K and V repeated to the query heads, or gathered over the CP group
    q_view = g_r == 1  # Megatron's query reshape is a view of the fused QKV output only with one group
    qkv_kept = e == 4 or selective or not kv_new  # through a view: k.float() in fp32, the checkpoint's V, V
    norm_copies = (0 if e == 4 and q_view else 4 * a_r) + (0 if e == 4 else 4 * g_r)  # fp32 rows, by d
    qk_norms = b * s_r * (d * (norm_copies + e * (a_r + g_r)) + 4 * (a_r + g_r))
    qkv = e * b * s_r * d * (a_r + 2 * g_r) if qkv_kept else 0
    rope = 4 * e * s_r * d  # cos and sin, for q and for k
    query, out = e * b * s_r * a_r * d, e * b * s_r * a_r * d
    if selective:  # the checkpoint keeps q, the rotated k and V (a view of the QKV output) and the mask type
        core = e * b * s_r * g_r * d + 4
    else:
        n_kv = a_r if a_r > g_r else g_r
        scores = local_score_bytes(dtype) * b * a_r * s_r * s
        core = scores + e * b * s * d * n_kv * (2 if kv_new else 1)
    return _local_norm_bytes(b * s_h, h, e) + qk_norms + qkv + rope + query + core + out


def local_mlp_bytes(
    arch: Qwen3Arch, layout: Layout, work: Workload, moe: bool, dtype: str = "bfloat16"
) -> int:
    """The MLP half of one local-spec layer (pre-MLP norm to fc2) for backward, per micro-batch, in
    activations of ``dtype``: the module docstring's local-spec terms (routing balanced, all-gather
    dispatcher)."""
    e = _element_bytes(dtype)
    b, s, t = work.micro_batch, work.seq_len, layout.tp
    s_r = s // layout.cp
    s_h = s_r // t
    h = arch.hidden_size
    norm = _local_norm_bytes(b * s_h, h, e)
    if not moe:
        return norm + 5 * e * b * s_r * arch.ffn_hidden_size // t
    experts_n, k, etp, ep = arch.num_experts, arch.moe_topk, layout.expert_tp, layout.ep
    probs = 4 * k if arch.norm_topk_prob else 4 * experts_n  # softmax over the top-k logits, or over all E
    router = b * s_h * (8 * k + probs)
    if arch.router_aux_loss_coef > 0:
        router += 4 * experts_n * b * s_h + 8 * experts_n + 4
    routed = k * b * s_h * etp
    dispatcher = 5 * (experts_n // ep) * (b * s_h * etp * ep) + routed * (12 + e * h)
    experts = routed * 6 * e * arch.moe_ffn_hidden_size // etp
    return norm + router + dispatcher + experts


def final_norm_bytes(arch: Qwen3Arch, layout: Layout, work: Workload, dtype: str = "bfloat16") -> int:
    """What the last stage's final norm and the output layer keep of the hidden states for backward, per
    micro-batch: TE's fused norm keeps its input and output (4·b·s_h·h in bf16), our RMSNorm of the local
    spec its module-docstring terms."""
    b, s_h, h = work.micro_batch, work.seq_len // layout.cp // layout.tp, arch.hidden_size
    if work.transformer_impl == "local":
        return _local_norm_bytes(b * s_h, h, _element_bytes(dtype))
    return 4 * b * s_h * h


def layer_activation_bytes(arch: Qwen3Arch, layout: Layout, work: Workload, moe: bool) -> int:
    """Activations one transformer layer keeps for backward, per micro-batch, without full recompute
    (bytes, bf16). Transformer Engine's layers: ``q`` is what a quantized GEMM's saved input costs; in bf16
    (q = 2) these are the plain formulas. The local spec: :func:`local_attention_bytes` +
    :func:`local_mlp_bytes`."""
    if work.transformer_impl == "local":
        return local_attention_bytes(arch, layout, work) + local_mlp_bytes(arch, layout, work, moe)
    b, s, t, cp = work.micro_batch, work.seq_len, layout.tp, layout.cp
    s_r = s // cp
    s_h = s_r // t
    h, d = arch.hidden_size, arch.head_dim
    a_r, g_r = arch.num_attention_heads // t, arch.num_key_value_heads // t
    q = gemm_input_bytes(work.fp8)
    attention = (2 + q) * b * s_h * h + 6 * b * s_r * d * (a_r + g_r)
    if work.fp8 is not None:  # the output projection's FP8 copy of O, beside flash attention's bf16 O
        attention += q * b * s_r * d * a_r
    if moe:
        k, etp = arch.moe_topk, layout.expert_tp
        mlp = 4 * b * s_h * h + 4 * b * s_h * arch.num_experts
        mlp += (2 + q) * k * b * s_h * etp * h + (4 + q) * k * b * s_h * arch.moe_ffn_hidden_size
    else:
        mlp = (2 + q) * b * s_h * h + (4 + q) * b * s_r * Fraction(arch.ffn_hidden_size, t)
    return math.ceil(attention + mlp)


def _stage_params(arch: Qwen3Arch, layout: Layout, layers: range, first: bool, last: bool) -> tuple[int, int]:
    """(dense, expert) parameters held by one rank of a stage; dense ones are split over tp or replicated."""
    p = param_counts(arch, arch.padded_vocab_size(VOCAB_PAD_MULTIPLE))
    moe = _moe_layers(arch)
    t = layout.tp
    split = sum(p.attention + (0 if moe[i] else p.dense_mlp) for i in layers)
    replicated = sum(p.norms + (p.router if moe[i] else 0) for i in layers)
    if first:
        split += p.embedding
    if last:  # tied embeddings keep a copy on the last stage when pp > 1
        split += p.output or (p.embedding if layout.pp > 1 else 0)
        replicated += p.final_norm
    experts = sum(p.experts for i in layers if moe[i]) // (layout.ep * layout.expert_tp)
    return split // t + replicated, experts


def _stage_linear_params(arch: Qwen3Arch, layout: Layout, layers: range) -> int:
    """``P_lin`` of one rank of a stage: the weights TE quantizes under FP8 (attention and dense MLPs split
    over tp, experts over ep·etp; no embedding, output layer, router or norm)."""
    p = param_counts(arch)
    moe = _moe_layers(arch)
    split = sum(p.attention + (0 if moe[i] else p.dense_mlp) for i in layers)
    experts = sum(p.experts for i in layers if moe[i]) // (layout.ep * layout.expert_tp)
    return split // layout.tp + experts


def _stage_activations(arch: Qwen3Arch, layout: Layout, work: Workload, layers: range, in_flight: int) -> int:
    """Activations of a stage's layers for ``in_flight`` micro-batches (full recompute: layer inputs, plus
    one layer's whole set while it is recomputed); with the local spec, each micro-batch's mask."""
    moe = _moe_layers(arch)
    n_moe = sum(moe[i] for i in layers)
    kinds = [(n_moe, True), (len(layers) - n_moe, False)]
    per_kind = [(n, layer_activation_bytes(arch, layout, work, kind)) for n, kind in kinds if n]
    s_r = work.seq_len // layout.cp
    mask = 0 if work.flash_attention else in_flight * work.micro_batch * s_r * work.seq_len  # bool
    if work.recompute != "full":
        return in_flight * sum(n * size for n, size in per_kind) + mask
    s_h = s_r // layout.tp
    return (
        in_flight * len(layers) * 2 * work.micro_batch * s_h * arch.hidden_size
        + max(size for _, size in per_kind)
        + mask
    )


def local_score_buffer_bytes(arch: Qwen3Arch, layout: Layout, work: Workload) -> int:
    """Megatron's global "mpu" buffer under the local spec (bf16, held by the rank for the run): where
    baddbmm's scores are preallocated, one layer's worth, and which the sequence-parallel all-gathers of the
    linears' inputs and the MoE all-gather dispatcher's tokens reuse, so it is the largest of the three;
    0 with Transformer Engine's layers (TE gathers into buffers of its own, and flash attention needs
    none)."""
    if work.flash_attention:
        return 0
    b, s, t = work.micro_batch, work.seq_len, layout.tp
    s_r = s // layout.cp
    scores = 2 * b * (arch.num_attention_heads // t) * s_r * s
    gathered = s_r if t > 1 else 0  # tokens a sequence-parallel all-gather collects, per sequence
    if arch.is_moe and layout.expert_tp * layout.ep > 1:  # the dispatcher gathers over etp·ep ranks
        gathered = max(gathered, s_r // t * layout.expert_tp * layout.ep)
    return max(scores, 2 * b * gathered * arch.hidden_size)


def rollout_bytes(arch: Qwen3Arch, rollout: Rollout) -> tuple[int, int]:
    """(engine weights, KV cache) per GPU of a vLLM engine spanning ``rollout.tp`` GPUs."""
    if rollout.tp is None:
        raise PlanError("is None; pick an engine size (plan() tries each)", "rollout_tp")
    p = param_counts(arch)
    weights = (2 * p.total - (p.linear if rollout.fp8 else 0)) // rollout.tp  # FP8: linear layers at 1 B
    kv_heads = max(1, arch.num_key_value_heads // rollout.tp)
    per_token = 2 * arch.num_layers * kv_heads * arch.head_dim * 2
    return weights, per_token * rollout.max_seqs * rollout.seq_len


def rollout_tp_choices(arch: Qwen3Arch, gpus: int) -> list[int]:
    """Engine sizes vLLM accepts for ``arch`` that tile ``gpus``, smallest first."""
    choices = []
    for rtp in _divisors(gpus):
        try:
            check_rollout(arch, rtp, gpus)
        except PlanError:
            continue
        choices.append(rtp)
    return choices


def check_rollout(arch: Qwen3Arch, rtp: int, gpus: int) -> None:
    """vLLM's rules for an engine of ``rtp`` GPUs; the error names ``rollout_tp``."""
    kv = arch.num_key_value_heads
    if gpus % rtp:
        raise PlanError(f"{rtp} does not divide the {gpus} GPUs the engines share", "rollout_tp")
    if arch.num_attention_heads % rtp or (kv % rtp and rtp % kv):
        raise PlanError(
            f"{rtp} must divide the attention heads ({arch.num_attention_heads}) and divide or be a multiple "
            f"of the KV heads ({kv}) (vLLM)",
            "rollout_tp",
        )


def memory(arch: Qwen3Arch, layout: Layout, work: Workload, rollout: Rollout, cluster: Cluster) -> Memory:
    """Per-GPU memory of the worst pipeline stage (see the module docstring for every term)."""
    check_layout(arch, layout, cluster.gpus, work.seq_len, fp8=work.fp8 is not None)
    sizes = stage_layers(arch, layout)
    micro = micro_batches(layout, work)
    r_weights, kv = rollout_bytes(arch, rollout) if rollout.colocated else (0, 0)
    t, cp = layout.tp, layout.cp
    shards = (layout.dp * cp, layout.edp) if work.distributed_optimizer else (1, 1)
    worst: Memory | None = None
    start = 0
    for i, n in enumerate(sizes):
        layers = range(start, start + n)
        start += n
        first, last = i == 0, i == layout.pp - 1
        dense, experts = _stage_params(arch, layout, layers, first, last)
        cache = FP8_WEIGHT_COPIES * _stage_linear_params(arch, layout, layers) if work.fp8 is not None else 0
        acts = _stage_activations(arch, layout, work, layers, min(layout.pp - i, micro))
        acts += local_score_buffer_bytes(arch, layout, work)
        logits = 0
        if last:
            acts += final_norm_bytes(arch, layout, work)
            vocab = arch.padded_vocab_size(VOCAB_PAD_MULTIPLE) // t
            logits = math.ceil(work.micro_batch * (work.seq_len // cp) * vocab * work.logits_bytes)
        mem = Memory(
            stage=i,
            weights=2 * (dense + experts) + cache,
            grads=work.grad_bytes * (dense + experts),
            optimizer=12 * dense // shards[0] + 12 * experts // shards[1],
            activations=acts,
            logits=logits,
            rollout_weights=r_weights,
            kv_cache=kv,
            overhead=round(cluster.overhead_gib * GIB),
            colocated=rollout.colocated,
            trainer_offload=rollout.trainer_offload,
            fp8_weight_cache=cache,
        )
        if worst is None or mem.total > worst.total:
            worst = mem
    assert worst is not None
    return worst


# ----------------------------------------------------------------------------------------------- cost
@dataclass(frozen=True)
class CostModel:
    """Constants of the step-time heuristic (H100-like; only ratios between layouts matter)."""

    flops_per_s: float = 4.0e14  # achieved bf16 matmul throughput per GPU
    intra_node_bytes_per_s: float = 1.5e11  # NVLink, per GPU, effective
    inter_node_bytes_per_s: float = 2.5e10  # network, per GPU, effective


def micro_batches(layout: Layout, work: Workload) -> int:
    """Micro-batches per data-parallel rank and step (rounded up: a partial one still takes a slot)."""
    return -(-work.global_batch // (layout.dp * work.micro_batch))


def step_seconds(
    arch: Qwen3Arch, layout: Layout, work: Workload, cluster: Cluster, model: CostModel
) -> float:
    """Estimated seconds per optimizer step (heuristic; see the module docstring)."""
    p = param_counts(arch)
    moe = _moe_layers(arch)
    t, pp, cp, ep, etp, dp = layout.tp, layout.pp, layout.cp, layout.ep, layout.expert_tp, layout.dp
    b, s = work.micro_batch, work.seq_len
    m = micro_batches(layout, work)
    attn_fwd = 2 * arch.num_attention_heads * arch.head_dim * s * arch.num_layers  # per token, causal
    fwd = 2 * p.matmul_active + attn_fwd
    per_token = 3 * fwd + {"none": 0, "selective": attn_fwd, "full": fwd}[work.recompute]
    tokens = m * dp * b * s
    compute = per_token * tokens / (cluster.gpus * model.flops_per_s)

    def bw(span: int) -> float:
        return model.intra_node_bytes_per_s if span <= cluster.gpus_per_node else model.inter_node_bytes_per_s

    layers_per_stage = max(stage_layers(arch, layout))
    moe_per_stage = math.ceil(sum(moe) / pp)
    s_h = s // cp // t
    per_micro = 0.0
    if t > 1:  # SP all-gather/reduce-scatter: 4 forward, 4 backward (+4 when full recompute re-runs forward)
        colls = 8 + (4 if work.recompute == "full" else 0)
        volume = colls * (t - 1) / t * b * (s // cp) * arch.hidden_size * 2
        per_micro += layers_per_stage * volume / bw(t)
    if ep > 1:  # dispatch + combine, forward and backward
        volume = 4 * (ep - 1) / ep * arch.moe_topk * b * s_h * etp * arch.hidden_size * 2
        per_micro += moe_per_stage * volume / bw(ep * etp)
    if cp > 1:  # ring attention: K, V forward; K, V and their grads backward
        kv_chunk = b * (s // cp) * 2 * (arch.num_key_value_heads // t) * arch.head_dim * 2
        per_micro += layers_per_stage * 3 * (cp - 1) * kv_chunk / bw(t * cp)
    if pp > 1:
        per_micro += 2 * b * s_h * arch.hidden_size * 2 / bw(cluster.gpus)
    bubble = (m + pp - 1) / m
    dense, experts = _stage_params(arch, layout, range(layers_per_stage), True, pp == 1)
    dp_sync = 0.0
    for params, group, span in ((dense, dp * cp, t * cp * dp), (experts, layout.edp, t * cp * dp)):
        if group > 1:
            dp_sync += (work.grad_bytes + 2) * params * (group - 1) / group / bw(span)
    return (compute + m * per_micro) * bubble + dp_sync


# ------------------------------------------------------------------------------------------- planning
@dataclass(frozen=True)
class Candidate:
    layout: Layout
    workload: Workload
    rollout: Rollout
    memory: Memory
    seconds: float
    fits: bool
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Plan:
    """Candidates that fit, cheapest first, and the leanest ones that do not."""

    arch: Qwen3Arch
    cluster: Cluster
    workload: Workload  # recompute: the first mode tried; each candidate carries its own
    rollout: Rollout
    fitting: tuple[Candidate, ...]
    not_fitting: tuple[Candidate, ...]
    considered: int
    best_seconds: float = 0.0

    def relative_cost(self, c: Candidate) -> float:
        return c.seconds / self.best_seconds if self.best_seconds else 1.0


def _divisors(n: int) -> list[int]:
    return [i for i in range(1, n + 1) if n % i == 0]


def enumerate_layouts(
    arch: Qwen3Arch, gpus: int, seq_len: int, min_cp_tokens: int = 4096, *, fp8: bool = False
) -> Iterator[Layout]:
    """Every valid layout for ``gpus``: tp dividing the KV heads, pp up to the layer count, cp only while
    each rank keeps at least ``min_cp_tokens`` of the sequence, ep dividing the experts, etp in {1, tp}
    (and with ``fp8``, FP8-aligned token shards)."""
    for tp in _divisors(gpus):
        for pp in _divisors(gpus // tp):
            for cp in _divisors(gpus // (tp * pp)):
                if cp > 1 and seq_len // cp < min_cp_tokens:
                    continue
                dp = gpus // (tp * pp * cp)
                eps = _divisors(arch.num_experts) if arch.is_moe else [1]
                for ep in eps:
                    for etp in sorted({1, tp}) if ep > 1 else [tp]:
                        first, last = layout_rules.balanced_ends(arch.num_layers, pp)
                        layout = Layout(
                            tp=tp,
                            pp=pp,
                            cp=cp,
                            ep=ep,
                            etp=etp,
                            dp=dp,
                            first_stage_layers=first,
                            last_stage_layers=last,
                        )
                        try:
                            check_layout(arch, layout, gpus, seq_len, fp8=fp8)
                        except PlanError:
                            continue
                        yield layout


def notes(layout: Layout, cluster: Cluster) -> tuple[str, ...]:
    """Placement remarks: groups that span nodes pay network instead of NVLink bandwidth."""
    out = []
    if layout.tp > cluster.gpus_per_node:
        out.append("tp spans nodes")
    if layout.ep * layout.expert_tp > cluster.gpus_per_node:
        out.append("ep*etp spans nodes (all-to-all over the network)")
    if layout.tp * layout.cp > cluster.gpus_per_node:
        out.append("cp spans nodes")
    return tuple(out)


def evaluate(
    arch: Qwen3Arch, layout: Layout, work: Workload, rollout: Rollout, cluster: Cluster, model: CostModel
) -> Candidate:
    mem = memory(arch, layout, work, rollout, cluster)
    fits = mem.total <= cluster.gpu_mem_gib * GIB
    seconds = step_seconds(arch, layout, work, cluster, model)
    return Candidate(layout, work, rollout, mem, seconds, fits, notes(layout, cluster))


def _first_fitting(tries: Iterator[Candidate]) -> Candidate:
    """The first candidate that fits (engine sizes come smallest first), else the last one tried."""
    last = None
    for last in tries:
        if last.fits:
            return last
    assert last is not None
    return last


def plan(
    arch: Qwen3Arch,
    cluster: Cluster,
    work: Workload,
    rollout: Rollout,
    *,
    layouts: Sequence[Layout] | None = None,
    recomputes: Sequence[Recompute] | None = None,
    model: CostModel | None = None,
    keep_not_fitting: int = 3,
) -> Plan:
    """Evaluate ``layouts`` (default: all of :func:`enumerate_layouts`) under each recompute mode and rank
    them. Selective recompute is skipped with flash attention: it stores exactly what ``none`` stores.
    With colocated engines of unset size, each candidate gets the smallest engine that lets it fit."""
    model = model or CostModel()
    if rollout.colocated and rollout.tp is not None:
        check_rollout(arch, rollout.tp, cluster.gpus)
    if recomputes is None:
        recomputes = ("none", "full") if work.flash_attention else RECOMPUTE
    if layouts is None:
        layouts = list(enumerate_layouts(arch, cluster.gpus, work.seq_len, fp8=work.fp8 is not None))
    engines = [rollout]
    if rollout.colocated and rollout.tp is None:
        sizes = [rtp for rtp in rollout_tp_choices(arch, cluster.gpus) if rtp <= rollout.max_auto_tp]
        engines = [replace(rollout, tp=rtp) for rtp in sizes]
        if not engines:
            raise PlanError(
                f"no vLLM engine of at most {rollout.max_auto_tp} GPUs tiles {cluster.gpus} GPUs with this "
                "model's heads",
                "rollout_tp",
            )
    candidates = []
    for layout in layouts:
        for recompute in recomputes:
            w = replace(work, recompute=recompute)
            tries = (evaluate(arch, layout, w, engine, cluster, model) for engine in engines)
            candidates.append(_first_fitting(tries))
    fitting = sorted((c for c in candidates if c.fits), key=lambda c: (c.seconds, c.memory.total))
    not_fitting = sorted((c for c in candidates if not c.fits), key=lambda c: (c.memory.total, c.seconds))
    ranked = fitting or not_fitting
    best = min((c.seconds for c in ranked), default=0.0)
    kept = tuple(not_fitting[:keep_not_fitting])
    return Plan(arch, cluster, work, rollout, tuple(fitting), kept, len(candidates), best)
