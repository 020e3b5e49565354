"""What ``mars eval`` evaluates: which model answers each role, as an HF directory the engines can load.

A training run leaves its policies in a ``mars train`` checkpoint (one ``shared`` policy folder, one per
role with ``algorithm.policies=per_role``, or one per policy of the graph's grouping with
``algorithm.policies=graph``); the agent graph says which role each folder answers. Each policy folder
is a mars Megatron checkpoint: model weights in Megatron's distributed format and the tokenizer under
``hf/``. Inference engines (transformers, vLLM) load HF safetensors, so a policy without HF weights is
converted once (``mars convert mcore-to-hf``, in child processes) into ``<out>/models/<policy>/`` and
reused by ``--resume``. An SFT output's ``hf/`` is a complete HF model already and is used as it is.

Pure path logic stays apart from the conversion, so the routing (which role reads which folder) is
checked before anything heavy starts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from mars_megatron.agents.graph import AgentGraph
from mars_megatron.json_file import read_json

SHARED = "shared"
MODELS_DIR = "models"
"""Under ``--out``: HF conversions of policies that had none."""


class PolicyError(ValueError):
    """A model or checkpoint path that cannot be evaluated; the message names the path and the flag."""


@dataclass(frozen=True)
class PolicySource:
    """One model to load: ``name`` (``shared``, a role, or ``model``) and the folder the user gave."""

    name: str
    path: Path


def _is_hf_model(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _is_mars_checkpoint(path: Path) -> bool:
    from mars_megatron.convert import is_mcore_checkpoint

    return is_mcore_checkpoint(path)


def checkpoint_step(checkpoint: str | Path) -> Path:
    """The step folder of a ``mars train`` checkpoint: ``checkpoint`` itself when it is one, else the
    newest complete one under it (a ``checkpoint.save_dir``)."""
    from mars_megatron.checkpoint.store import STATE_FILE, CheckpointStore

    path = Path(checkpoint)
    if (path / STATE_FILE).is_file():
        return path
    if not path.is_dir():
        raise PolicyError(f"--checkpoint {path}: no such directory")
    latest = CheckpointStore(path, keep_last=1).latest()
    if latest is None:
        raise PolicyError(
            f"--checkpoint {path}: neither a checkpoint (no {STATE_FILE}) nor a checkpoint.save_dir holding "
            "a complete one"
        )
    return latest


def checkpoint_policies(checkpoint: str | Path, graph: AgentGraph) -> tuple[Path, dict[str, PolicySource]]:
    """The step folder of ``checkpoint`` and, for every role of ``graph``, the policy folder that answers
    it (the ``shared`` one, the role's own under ``algorithm.policies=per_role``, or its group's under
    ``algorithm.policies=graph``)."""
    from mars_megatron.checkpoint.store import CheckpointStore

    step = checkpoint_step(checkpoint)
    try:
        names = CheckpointStore.load_state(step)["policies"]
    except KeyError:
        raise PolicyError(f"--checkpoint {step}: its trainer state lists no 'policies'") from None
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise PolicyError(
            f"--checkpoint {step}: field 'policies' of its trainer state is {names!r}, not names"
        )
    modes = [m for m in ("shared", "per_role", "graph") if sorted(names) == sorted(graph.policy_names(m))]
    if not modes:
        raise PolicyError(
            f"--checkpoint {step}: policies {names} are neither ['shared'] nor one per role nor graph "
            f"{graph.name!r}'s grouping {sorted(graph.policies)}"
        )
    routing = {role: graph.policy_of(role, graph.policy_names(modes[0])) for role in graph.roles}
    sources = {}
    for role, name in routing.items():
        folder = step / name
        if not _is_mars_checkpoint(folder):
            raise PolicyError(f"--checkpoint {step}: policy folder {folder} is missing or incomplete")
        sources[role] = PolicySource(name, folder)
    return step, sources


def model_policies(model: str | Path, graph: AgentGraph) -> dict[str, PolicySource]:
    """One model (an HF directory or a mars checkpoint folder) for every role."""
    path = Path(model)
    if not path.is_dir():
        raise PolicyError(f"--model {path}: no such directory")
    if not (_is_hf_model(path) or _is_mars_checkpoint(path)):
        raise PolicyError(
            f"--model {path}: neither an HF model (config.json and *.safetensors) nor a mars checkpoint"
        )
    return dict.fromkeys(graph.roles, PolicySource("model", path))


def override_roles(
    sources: Mapping[str, PolicySource], overrides: Mapping[str, str]
) -> dict[str, PolicySource]:
    """``--policy ROLE=DIR``: answer ``ROLE`` (a role of the graph, a key of ``sources``) with another
    model (e.g. a trained judging role beside an untrained first role)."""
    out = dict(sources)
    for role_name, folder in overrides.items():
        if role_name not in sources:
            valid = ", ".join(sources)
            raise PolicyError(f"--policy {role_name}=...: unknown role; valid roles: {valid}")
        path = Path(folder)
        if not (_is_hf_model(path) or _is_mars_checkpoint(path)):
            raise PolicyError(f"--policy {role_name}={path}: neither an HF model nor a mars checkpoint")
        out[role_name] = PolicySource(role_name, path)
    return out


def describe(sources: Mapping[str, PolicySource]) -> dict[str, str]:
    """``{role: path}``, for config.json and logs (what answered each role)."""
    return {role: str(source.path.resolve()) for role, source in sources.items()}


Convert = Callable[[Path, Path], None]
"""``convert(mcore_dir, hf_out)``: write an HF model of a mars checkpoint (atomically)."""


def hf_dirs(sources: Mapping[str, PolicySource], cache: Path, convert: Convert) -> dict[str, Path]:
    """An HF directory per role: HF models as they are, an SFT output's complete ``hf/``, else a
    conversion under ``cache`` (made once per distinct folder, reused when already complete)."""
    made: dict[Path, Path] = {}
    out = {}
    for role, source in sources.items():
        path = source.path.resolve()
        if path not in made:
            made[path] = _hf_dir(source, cache, convert)
        out[role] = made[path]
    return out


def _hf_dir(source: PolicySource, cache: Path, convert: Convert) -> Path:
    if _is_hf_model(source.path):
        return source.path
    if _is_hf_model(source.path / "hf"):
        return source.path / "hf"
    target = cache / MODELS_DIR / source.name
    stamp = target / "converted_from.json"
    origin = str(source.path.resolve())
    saved = read_json(stamp, PolicyError) if stamp.is_file() else None
    if _is_hf_model(target) and isinstance(saved, dict) and saved.get("source") == origin:
        return target
    if target.exists():
        raise PolicyError(f"{target}: holds another conversion; remove it or choose another --out")
    target.parent.mkdir(parents=True, exist_ok=True)
    convert(source.path, target)
    stamp.write_text(json.dumps({"source": origin}) + "\n")
    return target


def convert_with_mars(mcore_dir: Path, out: Path) -> None:
    """:data:`Convert` by ``mars convert mcore-to-hf``'s job, on the smallest layout (one process)."""
    from mars_megatron import jobs
    from mars_megatron.config import ParallelConfig

    layout = ParallelConfig()
    jobs.run(jobs.mcore_to_hf_job, layout, str(mcore_dir), str(out), layout, 5 * 2**30, "auto", nproc=1)
