"""Rollout engine on plain ``transformers``: the default for the tiny CPU models and the reference the
other engines are tested against.

Batched decoding with a KV cache over left-padded prompts; sampling is done per request with its own
seeded generator, so a request's output does not depend on what it was batched with.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch

from mars_megatron.dtypes import torch_dtype
from mars_megatron.rollout.engine import GenerationOutput, GenerationRequest, SamplingParams
from mars_megatron.transfer.channel import TransferStats
from mars_megatron.transfer.group import GroupSpec
from mars_megatron.transfer.plan import TransferPlan
from mars_megatron.transfer.receiver import ReceivingEnd

# Hub-layout expert tensors; transformers 5 keeps them fused per layer in memory.
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from ``logits`` [vocab] under temperature / top-k / top-p (greedy at temperature 0)."""
    if params.temperature == 0:
        return int(logits.argmax())
    scaled = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = sorted_probs.cumsum(0) - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def has_weights(model_dir: str | Path) -> bool:
    """Whether an HF directory holds weight files, or only config and tokenizer."""
    return any(Path(model_dir).glob("*.safetensors")) or any(Path(model_dir).glob("*.bin"))


def _generation_config(model_dir: str | Path):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_dir)
    except OSError:  # no generation_config.json: derive it from config.json
        from transformers import AutoConfig

        return GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_dir))


class HFEngine:
    """A :class:`~mars_megatron.rollout.engine.RolloutEngine` on a transformers causal LM."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str = "float32",
        max_batch: int = 16,
        seed: int = 0,
        capture_routing: bool = False,
    ) -> None:
        """``capture_routing``: return each output's routed experts (``GenerationOutput.routed_experts``)
        read from the routers of a MoE model; a dense model refuses it."""
        from transformers import AutoConfig, AutoModelForCausalLM

        from mars_megatron.rollout.chat import refuse_remote_code

        refuse_remote_code(model_dir)
        if has_weights(model_dir):
            self.model = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch_dtype(dtype), trust_remote_code=False
            ).eval()
        else:
            # Config only (a mars Megatron checkpoint's hf/ directory): the trainer pushes the weights
            # with update_weights before the first rollout.
            config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
            self.model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype(dtype)).eval()
            self.model.generation_config = _generation_config(model_dir)
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        pad = self.model.generation_config.pad_token_id
        self.pad_id = int(pad if pad is not None else 0)
        self.max_batch = max_batch
        # what a prompt may hold (the OpenAI server refuses ids and lengths past them instead of failing)
        self.vocab_size = int(self.model.config.vocab_size)
        self.max_positions = int(self.model.config.max_position_embeddings)
        self._seeds = torch.Generator().manual_seed(seed)
        self.routing = _RoutingCapture(self.model) if capture_routing else None

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        out: list[GenerationOutput] = []
        for start in range(0, len(requests), self.max_batch):
            out += self._generate_batch(requests[start : start + self.max_batch])
        return out

    @torch.no_grad()
    def _generate_batch(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        from transformers import DynamicCache

        batch = len(requests)
        longest = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((batch, longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros(batch, longest, dtype=torch.long)
        for i, r in enumerate(requests):
            ids[i, longest - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[i, longest - len(r.prompt_ids) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        generators = [
            torch.Generator().manual_seed(
                r.sampling.seed
                if r.sampling.seed is not None
                else int(torch.randint(2**62, (1,), generator=self._seeds))
            )
            for r in requests
        ]
        cache = DynamicCache()
        logits = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True
        ).logits[:, -1]
        results = [GenerationOutput(r.request_id, [], [], "length") for r in requests]
        active = [True] * batch
        # routed experts per request, one [positions, layers, k] block per model call
        routed: list[list[torch.Tensor]] = [[] for _ in requests]
        if self.routing is not None:
            prefill = self.routing.take(batch, longest)
            for i, r in enumerate(requests):
                routed[i].append(prefill[i, longest - len(r.prompt_ids) :])
        for _ in range(max(r.sampling.max_tokens for r in requests)):
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            step = torch.full((batch, 1), self.pad_id, dtype=torch.long)
            for i, r in enumerate(requests):
                if not active[i]:
                    continue
                token = sample_token(logits[i], r.sampling, generators[i])
                results[i].token_ids.append(token)
                results[i].logprobs.append(float(logprobs[i, token]))
                step[i, 0] = token
                if token in self.eos_ids or token in r.sampling.stop_token_ids:
                    results[i].finish_reason, active[i] = "stop", False
                elif len(results[i].token_ids) >= r.sampling.max_tokens:
                    active[i] = False
            if not any(active):
                break
            mask = torch.cat([mask, torch.ones(batch, 1, dtype=torch.long)], dim=1)
            positions = positions[:, -1:] + 1
            logits = self.model(
                input_ids=step,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1]
            if self.routing is not None:  # only rows still decoding fed a token that is not their last
                fed = self.routing.take(batch, 1)
                for i in range(batch):
                    if active[i]:
                        routed[i].append(fed[i])
        if self.routing is not None:
            for i, out in enumerate(results):
                out.routed_experts = torch.cat(routed[i]).numpy().astype(self.routing.dtype)
        return results

    # ------------------------------------------------------------------ weight transfer (TransferTarget)
    transfer_ranks = 1
    _receiving: ReceivingEnd | None = None

    def join_transfer(self, groups: Mapping[int, GroupSpec], first_rank: int) -> None:
        if self._receiving is None:
            self._receiving = ReceivingEnd()
        self._receiving.join(groups, first_rank)

    def receive_weights(self, plan: TransferPlan, load: bool = True) -> TransferStats:
        """Each bucket is copied into the parameters as it arrives (:meth:`update_weights`)."""
        if self._receiving is None:
            raise RuntimeError("receive_weights() before join_transfer()")
        return self._receiving.receive(plan, self.update_weights if load else len)

    def leave_transfer(self) -> None:
        if self._receiving is not None:
            self._receiving.leave()

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy HF hub-named tensors into the model, including per-expert tensors into fused experts."""
        params = dict(self.model.named_parameters())
        loaded = 0
        for name, tensor in named_tensors:
            m = _EXPERT.match(name)
            if m is not None:
                prefix, expert, which = m.group(1), int(m.group(2)), m.group(3)
                if which == "down_proj":
                    target = params[f"{prefix}.down_proj"][expert]
                else:
                    fused = params[f"{prefix}.gate_up_proj"][expert]
                    half = fused.shape[0] // 2
                    target = fused[:half] if which == "gate_proj" else fused[half:]
            elif name in params:
                target = params[name]
            else:
                raise KeyError(f"update_weights: the model has no parameter for HF tensor '{name}'")
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"update_weights: '{name}' has shape {list(tensor.shape)}, "
                    f"the model expects {list(target.shape)}"
                )
            target.copy_(tensor)
            loaded += 1
        return loaded


class _RoutingCapture:
    """Reads the expert ids every MoE router of a transformers Qwen3-MoE model picks (forward hooks on
    each layer's ``mlp.gate``, whose output is ``(logits, weights, indices)``): the routing this engine
    really used, for the trainer to replay."""

    def __init__(self, model: torch.nn.Module) -> None:
        from mars_megatron.rollout.engine import routing_dtype

        layers = getattr(getattr(model, "model", None), "layers", None) or []
        gates = [layer.mlp.gate for layer in layers if hasattr(getattr(layer, "mlp", None), "experts")]
        if not gates:
            raise ValueError(
                f"capture_routing: {type(model).__name__} has no MoE layers (no router to read); "
                "routing replay is for MoE models"
            )
        self.num_experts = int(model.config.num_experts)
        self.dtype = routing_dtype(self.num_experts)
        self._last: list[torch.Tensor | None] = [None] * len(gates)
        for k, gate in enumerate(gates):
            gate.register_forward_hook(self._hook(k))

    def _hook(self, k: int):
        def hook(module: torch.nn.Module, args: object, output: tuple[torch.Tensor, ...]) -> None:
            self._last[k] = output[2]

        return hook

    def take(self, batch: int, length: int) -> torch.Tensor:
        """The last model call's routing as ``[batch, length, layers, k]``."""
        if any(t is None for t in self._last):
            raise RuntimeError("capture_routing: a MoE layer's router did not run in the last model call")
        out = torch.stack([t.view(batch, length, -1) for t in self._last], dim=2)  # type: ignore[union-attr]
        self._last = [None] * len(self._last)
        return out
