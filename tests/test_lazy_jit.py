"""megatron-core imported through ``mars_megatron`` defers its ``torch.compile`` decorations to the first
call (mars_megatron/lazy_jit.py): the import skips torch's compiler stack, the compiled functions are the
same, and nothing outside megatron-core's import changes. Each case runs in a fresh interpreter, since the
hook acts once, on the process's first import of megatron-core."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(code: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


MEGATRON_THEN_PROBE = """
import json, sys
{first}
import megatron.core.models.gpt, megatron.core.optimizer, megatron.core.dist_checkpointing
import megatron.core.jit as jit
import megatron.core.fusions.fused_bias_swiglu as swiglu
import torch
print(json.dumps({{
    "dynamo_loaded": "torch._dynamo" in sys.modules,
    "jit_fuser": jit.jit_fuser.__name__,
    "swiglu_deferred": getattr(swiglu.swiglu, "__mars_deferred_compile__", False),
    "swiglu_name": swiglu.swiglu.__name__,
    "torch_compile_restored": torch.compile.__module__ == "torch" and torch.compile.__name__ == "compile",
}}))
"""


def test_megatron_imported_through_mars_skips_the_compiler_stack() -> None:
    got = _run(MEGATRON_THEN_PROBE.format(first="import mars_megatron"))
    assert got == {
        "dynamo_loaded": False,
        "jit_fuser": "compile_later",
        "swiglu_deferred": True,
        "swiglu_name": "swiglu",  # functools.wraps: megatron's name, docstring and signature
        "torch_compile_restored": True,
    }


def test_megatron_imported_first_keeps_its_own_decoration() -> None:
    got = _run(MEGATRON_THEN_PROBE.format(first="import megatron.core\nimport mars_megatron"))
    assert got["dynamo_loaded"] is True and got["jit_fuser"] == "compile"
    assert got["swiglu_deferred"] is False and got["torch_compile_restored"] is True


FIRST_CALL = """
import json, sys
import mars_megatron, megatron.core.jit as jit, torch
import torch._dynamo.utils  # the compiler's counters (imported here only to read them)
def gate(x, y):
    return torch.nn.functional.silu(x) * y
fused = jit.jit_fuser(gate, backend="eager")  # the arguments reach torch.compile unchanged
before = sum(torch._dynamo.utils.counters["stats"].values())
x, y = torch.randn(4, 8), torch.randn(4, 8)
out = fused(x, y)
again = fused(x, y)
after = dict(torch._dynamo.utils.counters["stats"])
module = jit.jit_fuser(torch.nn.Linear(2, 2), backend="eager")
print(json.dumps({
    "before": before,
    "frames_compiled": after.get("unique_graphs", 0),
    "equal": torch.equal(out, gate(x, y)) and torch.equal(again, out),
    "module_type": type(module).__name__,
}))
"""


def test_the_first_call_compiles_through_torch_compile_with_the_same_arguments() -> None:
    got = _run(FIRST_CALL)
    assert got["before"] == 0  # nothing compiled at decoration
    assert got["frames_compiled"] == 1  # compiled once, by dynamo, on the first call; reused on the second
    assert got["equal"] is True
    assert got["module_type"] == "OptimizedModule"  # a module goes to torch.compile as it is


@pytest.mark.parametrize("first", ["import mars_megatron", ""])
def test_tracebacks_and_sources_of_megatron_core_still_read(first: str) -> None:
    got = _run(
        f"import json, inspect\n{first}\nimport megatron.core\n"
        "print(json.dumps({'source': 'import' in inspect.getsource(megatron.core)}))"
    )
    assert got == {"source": True}
