"""mars_megatron.training.cpu_compat: megatron-core's CUDA calls redirected to the CPU.

The layer patches torch and megatron process-wide and cannot be undone, so every check runs in a fresh
interpreter (``subprocess``) and reports what it observed as JSON; the pytest process itself is never
patched. ``CUDA_VISIBLE_DEVICES`` is emptied in the children so the layer is active even on a GPU host.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
MARK = "@@RESULT@@"

# Runs first in every child: ``probe(name, fn)`` stores fn's result, or "RAISES <type>: <message>".
PRELUDE = textwrap.dedent(
    """
    import json, warnings
    warnings.filterwarnings("ignore")
    import torch
    from mars_megatron.training import cpu_compat
    RESULT = {}

    def probe(name, fn):
        try:
            RESULT[name] = fn()
        except BaseException as e:
            RESULT[name] = f"RAISES {type(e).__name__}: {e}"
    """
)
EPILOGUE = f"\nprint({MARK!r} + json.dumps(RESULT, default=str))\n"


class Child:
    """PRELUDE + ``code`` running in a fresh interpreter; :meth:`result` is its RESULT dict."""

    def __init__(self, code: str) -> None:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PRELUDE + textwrap.dedent(code) + EPILOGUE],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._result: dict[str, Any] | None = None

    def result(self, timeout: float = 180.0) -> dict[str, Any]:
        if self._result is None:
            try:
                out, err = self.proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()
                raise
            assert self.proc.returncode == 0, f"child failed (rc={self.proc.returncode}):\n{err[-6000:]}"
            lines = [ln for ln in out.splitlines() if ln.startswith(MARK)]
            assert len(lines) == 1, out[-3000:]
            self._result = json.loads(lines[0][len(MARK) :])
        return self._result


def raised(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("RAISES ")


# One child probes the CUDA entry points megatron relies on before install() (they fail on this
# machine), then installs the layer and probes them again, along with megatron's patched helpers.
PROBE_CODE = """
probe("before_is_active", cpu_compat.is_active)
probe("before_cuda_available", torch.cuda.is_available)
probe("before_zeros_cuda", lambda: str(torch.zeros(2, device="cuda").device))
probe("before_current_device", torch.cuda.current_device)
probe("before_tensor_cuda", lambda: str(torch.ones(2).cuda().device))
probe("before_to_cuda", lambda: str(torch.ones(2).to("cuda").device))
probe("before_to_ordinal", lambda: str(torch.ones(2).to(0).device))
probe("before_pin_memory", lambda: torch.empty(3, pin_memory=True).is_pinned())
probe("before_stream", lambda: str(torch.cuda.Stream()))
probe("before_synchronize", torch.cuda.synchronize)
probe("before_type", lambda: torch.ones(2).type())

from megatron.core.transformer.moe import moe_utils, token_dispatcher

probe("gemm_before", lambda: hasattr(moe_utils, "te_general_gemm"))
probe("active_before", cpu_compat.is_active)
probe("install_1", cpu_compat.install)
first = [torch.zeros, torch.Tensor.to, torch.Tensor.type, torch.cuda.Stream,
         moe_utils.maybe_move_tensor_to_cpu]
probe("install_2", cpu_compat.install)
probe("not_rewrapped", lambda: [a is b for a, b in zip(first, [
    torch.zeros, torch.Tensor.to, torch.Tensor.type, torch.cuda.Stream,
    moe_utils.maybe_move_tensor_to_cpu])])
probe("active_after", cpu_compat.is_active)
probe("cuda_available", torch.cuda.is_available)

# factories: megatron's modules see a torch whose factories map CUDA to the CPU; torch itself is untouched
import megatron.core.optimizer.optimizer as megatron_optimizer
mt = megatron_optimizer.torch
probe(
    "global_torch_untouched", lambda: [mt is not torch, not hasattr(torch.tensor, "__mars_cpu_compat__")]
)
probe("global_zeros_cuda_still_raises", lambda: str(torch.zeros(2, device="cuda").device))
def fac(t):
    return [str(t.device), str(t.dtype), t.tolist()]

probe("zeros_cuda", lambda: fac(mt.zeros(2, device="cuda")))
probe("current_device", torch.cuda.current_device)
probe("empty_current", lambda: str(mt.empty(3, device=torch.cuda.current_device()).device))
probe("ones_cuda1", lambda: fac(mt.ones(2, device="cuda:1", dtype=torch.int64)))
probe("full_devobj", lambda: fac(mt.full((2,), 7.0, device=torch.device("cuda", 0))))
probe("tensor_cuda", lambda: fac(mt.tensor([1, 2, 3], device="cuda")))
probe("arange_cuda", lambda: fac(mt.arange(4, device="cuda")))
probe("as_tensor_cuda", lambda: fac(mt.as_tensor([1.5], device="cuda")))
probe("randn_cuda", lambda: list(mt.randn(2, 3, device="cuda").shape) + [
    str(mt.randn(1, device="cuda").device)])
probe("randint_cuda", lambda: str(mt.randint(0, 5, (3,), device=0).device))
probe("like_cuda", lambda: [fac(mt.zeros_like(torch.ones(2), device="cuda")),
                            fac(mt.full_like(torch.ones(2), 3.0, device="cuda"))])
probe("cpu_untouched", lambda: str(mt.zeros(1, device="cpu").device))
probe("pin_memory", lambda: [mt.empty(3, pin_memory=True).is_pinned(),
                             mt.zeros(2, pin_memory=True, device="cuda").tolist()])

# tensor methods
t = torch.arange(3, dtype=torch.float32)
probe("cuda_is_self", lambda: t.cuda() is t and t.cuda(0, non_blocking=True) is t)
probe("to_str", lambda: str(t.to("cuda").device))
probe("to_kw", lambda: str(t.to(device="cuda:0").device))
probe("to_int", lambda: str(t.to(0).device))
probe("to_devobj", lambda: str(t.to(torch.device("cuda")).device))
probe("to_dtype", lambda: [str(t.to(torch.float16).dtype), t.to(torch.float16).tolist()])
probe("to_dev_dtype", lambda: [str(t.to("cuda", torch.bfloat16).device),
                               str(t.to("cuda", torch.bfloat16).dtype)])
probe("to_kw_both", lambda: str(t.to(device="cuda", dtype=torch.float64).dtype))
probe("to_tensor", lambda: str(t.to(torch.ones(1, dtype=torch.int32)).dtype))
probe("type_names", lambda: [t.type(), t.bfloat16().type(), t.half().type(), t.long().type(),
                             t.bool().type()])
probe("type_convert", lambda: [str(t.type(torch.float64).dtype), t.type(torch.float64).tolist(),
                               t.type(torch.float64).type()])
m = torch.nn.Linear(2, 2)
probe("module_cuda", lambda: [str(m.cuda().weight.device), str(m.to("cuda").weight.device)])

# streams, events, synchronize, as megatron uses them
def streams():
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x = mt.ones(4, device="cuda") * 2
    torch.cuda.current_stream().wait_stream(s)
    x.record_stream(torch.cuda.current_stream())
    s.wait_event(torch.cuda.Event())
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    end.record(torch.cuda.current_stream())
    end.synchronize()
    return [x.tolist(), torch.cuda.synchronize(), torch.cuda.synchronize(0),
            start.elapsed_time(end) >= 0, torch.cuda.current_stream() == torch.cuda.default_stream(),
            torch.cuda.empty_cache(), torch.cuda.memory_allocated(), torch.cuda.set_device(0),
            s.query(), end.query()]

probe("streams", streams)

# megatron-specific fixes
probe("gemm_after",
      lambda: [hasattr(moe_utils, "te_general_gemm"), moe_utils.te_general_gemm is None])
def move(t, **kw):
    out = moe_utils.maybe_move_tensor_to_cpu(t, **kw)
    return [type(out).__module__ + "." + type(out).__name__, out.tolist()]
probe("move_numpy", lambda: move(torch.tensor([3, 1, 2]), as_numpy=True))
probe("move_tensor", lambda: move(torch.tensor([3, 1, 2]), as_numpy=False))
probe("dispatcher_patched",
      lambda: token_dispatcher.maybe_move_tensor_to_cpu is moe_utils.maybe_move_tensor_to_cpu)
"""


# A real megatron model, end to end (a MoE model with a dense first layer).
MODEL_CODE = """
import os, tempfile
from mars_megatron.config import ParallelConfig
from mars_megatron.training import parallel
from mars_megatron.models.hf_config import parse_hf_config
from mars_megatron.training.model_provider import build_model
from mars_megatron.conversion.model_io import SeededInit, load_weights
from mars_megatron.conversion.qwen3_mapping import init_tensor

if not USE_LAYER:
    # What a process without the layer gets: the entry points' install() calls do nothing.
    cpu_compat.install = lambda: False

# Qwen3-MoE with a dense first layer (mlp_only_layers) so both MLP kinds run; vocab 200 pads to 256.
arch = parse_hf_config({
    "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 200, "hidden_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "intermediate_size": 48, "max_position_embeddings": 64, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "norm_topk_prob": True,
    "mlp_only_layers": [0], "router_aux_loss_coef": 0.001, "dtype": "float32",
})
tmp = tempfile.TemporaryDirectory()  # removed when the child exits
store = os.path.join(tmp.name, "store")
parallel.init_distributed(0, 1, store)
parallel.init_model_parallel(ParallelConfig(), 1234)
RESULT["active"] = cpu_compat.is_active()
model = build_model(arch, ParallelConfig(), transformer_impl="local")
params = dict(model.named_parameters())
RESULT["loaded"] = [load_weights(model, SeededInit(arch, 7, torch.float32), arch, 256), len(params)]
RESULT["router_from_seed"] = torch.equal(
    params["decoder.layers.1.mlp.router.weight"],
    init_tensor("model.layers.1.mlp.gate.weight", (4, 32), 7, 0.02, torch.float32))
ids = torch.randint(0, 200, (2, 8), generator=torch.Generator().manual_seed(0))
pos = torch.arange(8).unsqueeze(0).expand(2, -1)
try:
    logits = model(ids, pos, attention_mask=None)
except BaseException as e:
    RESULT["forward"] = f"RAISES {type(e).__name__}: {e}"
else:
    loss = logits.sum()
    loss.backward()
    RESULT["forward"] = "ok"
    RESULT["shape"] = list(logits.shape)
    RESULT["device"] = str(logits.device)
    RESULT["loss_finite"] = bool(torch.isfinite(loss))
    RESULT["logits_finite"] = bool(torch.isfinite(logits).all())
    RESULT["padded_logits_zero"] = bool((logits[..., 200:] == 0).all())
    RESULT["no_grad"] = [n for n, p in params.items() if p.grad is None]
    RESULT["zero_grad"] = [n for n, p in params.items() if p.grad is not None and not p.grad.abs().sum() > 0]
parallel.destroy()
"""


@pytest.fixture(scope="module")
def children() -> Iterator[dict[str, Child]]:
    """Start every child at once so they run concurrently; each test waits only for its own."""
    started = {
        "probes": Child(PROBE_CODE),
        "model_with_layer": Child("USE_LAYER = True\n" + MODEL_CODE),
        "model_without_layer": Child("USE_LAYER = False\n" + MODEL_CODE),
    }
    yield started
    for child in started.values():  # a child no test waited for (deselected tests) is not left behind
        if child.proc.poll() is None:
            child.proc.kill()
        child.proc.communicate()


# ------------------------------------------------------------------------------------ without the layer
@pytest.fixture(scope="module")
def probes(children: dict[str, Child]) -> dict[str, Any]:
    return children["probes"].result()


def test_without_layer_cuda_calls_fail(probes: dict[str, Any]) -> None:
    r = {k.removeprefix("before_"): v for k, v in probes.items() if k.startswith("before_")}
    assert r["is_active"] is False
    assert r["cuda_available"] is False
    for name in ("zeros_cuda", "current_device", "tensor_cuda", "to_cuda", "to_ordinal", "pin_memory"):
        assert raised(r[name]), (name, r[name])
    assert raised(r["stream"]) and raised(r["synchronize"])
    assert r["type"] == "torch.FloatTensor"


# ---------------------------------------------------------------------------------- with the layer
@pytest.fixture(scope="module")
def installed(probes: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in probes.items() if not k.startswith("before_")}


def test_install_is_idempotent_and_reports_active(installed: dict[str, Any]) -> None:
    r = installed
    assert r["active_before"] is False
    assert r["install_1"] is True and r["install_2"] is True
    assert r["active_after"] is True
    # a second install() leaves every patched entry point as it is (nothing is wrapped twice)
    assert r["not_rewrapped"] == [True] * 5
    assert r["cuda_available"] is False  # the layer never pretends a GPU exists


def test_factories_with_cuda_devices_build_cpu_tensors(installed: dict[str, Any]) -> None:
    r = installed
    assert r["global_torch_untouched"] == [True, True]
    assert r["global_zeros_cuda_still_raises"].startswith("RAISES")
    assert r["zeros_cuda"] == ["cpu", "torch.float32", [0.0, 0.0]]
    assert r["current_device"] == 0
    assert r["empty_current"] == "cpu"
    assert r["ones_cuda1"] == ["cpu", "torch.int64", [1, 1]]
    assert r["full_devobj"] == ["cpu", "torch.float32", [7.0, 7.0]]
    assert r["tensor_cuda"] == ["cpu", "torch.int64", [1, 2, 3]]
    assert r["arange_cuda"] == ["cpu", "torch.int64", [0, 1, 2, 3]]
    assert r["as_tensor_cuda"] == ["cpu", "torch.float32", [1.5]]
    assert r["randn_cuda"] == [2, 3, "cpu"]
    assert r["randint_cuda"] == "cpu"
    assert r["like_cuda"] == [["cpu", "torch.float32", [0.0, 0.0]], ["cpu", "torch.float32", [3.0, 3.0]]]
    assert r["cpu_untouched"] == "cpu"


def test_pin_memory_is_dropped(installed: dict[str, Any]) -> None:
    assert installed["pin_memory"] == [False, [0.0, 0.0]]


def test_tensor_methods_stay_on_cpu_and_keep_dtype_conversion(installed: dict[str, Any]) -> None:
    r = installed
    assert r["cuda_is_self"] is True
    assert r["to_str"] == r["to_kw"] == r["to_int"] == r["to_devobj"] == "cpu"
    assert r["to_dtype"] == ["torch.float16", [0.0, 1.0, 2.0]]
    assert r["to_dev_dtype"] == ["cpu", "torch.bfloat16"]
    assert r["to_kw_both"] == "torch.float64"
    assert r["to_tensor"] == "torch.int32"
    assert r["module_cuda"] == ["cpu", "cpu"]


def test_tensor_type_names_cuda_types_but_still_converts(installed: dict[str, Any]) -> None:
    r = installed
    assert r["type_names"] == [
        "torch.cuda.FloatTensor",
        "torch.cuda.BFloat16Tensor",
        "torch.cuda.HalfTensor",
        "torch.cuda.LongTensor",
        "torch.cuda.BoolTensor",
    ]
    assert r["type_convert"] == ["torch.float64", [0.0, 1.0, 2.0], "torch.cuda.DoubleTensor"]


def test_streams_events_synchronize_are_usable_no_ops(installed: dict[str, Any]) -> None:
    assert installed["streams"] == [[2.0, 2.0, 2.0, 2.0], None, None, True, True, None, 0, None, True, True]


def test_megatron_fixes(installed: dict[str, Any]) -> None:
    r = installed
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        # megatron-core 0.16.1 without TE never defines te_general_gemm; install() defines it as None.
        assert r["gemm_before"] is False
        assert r["gemm_after"] == [True, True]
    else:
        assert r["gemm_after"][0] is True
    assert r["move_numpy"] == ["numpy.ndarray", [3, 1, 2]]
    assert r["move_tensor"] == ["torch.Tensor", [3, 1, 2]]
    assert r["dispatcher_patched"] is True


# ------------------------------------------------------------------ a real megatron model, end to end


def test_megatron_moe_model_forward_backward_on_cpu_with_layer(children: dict[str, Child]) -> None:
    r = children["model_with_layer"].result()
    assert r["active"] is True  # init_model_parallel installed it
    # 26 parameters: embedding, final norm, output layer (3); per layer input norm, qkv, proj, q/k norms,
    # pre-MLP norm (2 x 6); dense layer 0 fc1 + fc2 (2); MoE layer 1 router + 4 experts x (fc1, fc2) (9).
    # Every one of them was set from the seeded HF source.
    assert r["loaded"] == [26, 26]
    assert r["router_from_seed"] is True
    assert r["forward"] == "ok"
    assert r["shape"] == [2, 8, 256] and r["device"] == "cpu"
    assert r["loss_finite"] is True and r["logits_finite"] is True
    assert r["padded_logits_zero"] is True  # the zero rows added for vocab padding give zero logits
    assert r["no_grad"] == []
    assert r["zero_grad"] == []


def test_same_model_without_layer_fails_on_cuda(children: dict[str, Child]) -> None:
    r = children["model_without_layer"].result()
    assert r["active"] is False
    assert r["loaded"] == [26, 26]  # building and loading do not need the GPU here ...
    assert raised(r["forward"])  # ... but megatron's forward asks for a CUDA device
    assert "CUDA" in r["forward"], r["forward"]


def test_transformers_beside_megatron_computes_the_same_model(tmp_path: Path) -> None:
    """A Python-level torch.tensor breaks transformers' meta-device init (its rotary buffer came out zero or
    garbage), so the layer must leave torch's own factories alone: a transformers rollout engine lives in
    the same process as the megatron trainer during weight sync."""
    code = f"""
import sys, torch
if sys.argv[1] == "installed":
    from mars_megatron.training import cpu_compat
    cpu_compat.install()
from mars_megatron.models.presets import init_model
from transformers import AutoModelForCausalLM
path = init_model("tiny-dense", "{tmp_path}/" + sys.argv[1])
m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
with torch.no_grad():
    print(repr([m.model.rotary_emb.inv_freq.tolist(), m(torch.tensor([[5, 6, 7, 8]])).logits.sum().item()]))
"""
    outs = {}
    for mode in ("clean", "installed"):
        done = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr[-2000:]
        outs[mode] = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert outs["installed"] == outs["clean"]
    assert outs["clean"][0][0] == 1.0  # inv_freq[0] = theta**0
