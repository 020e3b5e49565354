"""The checks a conversion makes of where it writes and of what an HF export needs: named errors before
any work, and an export folder that loads in transformers before it is renamed into place."""

from __future__ import annotations

from pathlib import Path

from mars_megatron.checkpoint.errors import CheckpointError

__all__ = ["check_assets", "check_loadable", "check_output_dir"]


def check_output_dir(out_dir: str | Path) -> Path:
    from mars_megatron.config import check_output_place

    out = Path(out_dir)
    check_output_place(out, "output directory")  # the root, a system folder, the home folder itself
    if out.exists():
        raise FileExistsError(f"{out}: output directory already exists; choose a new path or remove it")
    if not out.parent.exists():
        raise FileNotFoundError(f"{out.parent}: parent of the output directory does not exist")
    return out


def check_assets(mcore_dir: str | Path) -> Path:
    """The checkpoint's ``hf/`` folder, checked to hold what an HF export needs to load anywhere."""
    assets = Path(mcore_dir) / "hf"
    for needed in ("config.json", "tokenizer_config.json"):  # an HF model without them loads nowhere
        if not (assets / needed).is_file():
            raise CheckpointError(
                f"{assets / needed}: missing; the checkpoint carries no HF {needed.split('.')[0]}, so its "
                "export would not load (copy the source model's config and tokenizer files into "
                f"{assets})"
            )
    return assets


def check_loadable(hf_dir: Path) -> None:
    """The exported folder's config and tokenizer load with transformers (checked before the folder is
    renamed into place, so a broken export never appears under the output name)."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        AutoConfig.from_pretrained(hf_dir)
        AutoTokenizer.from_pretrained(hf_dir)
    except Exception as e:  # transformers raises many types for a bad file
        raise CheckpointError(
            f"the export's config or tokenizer does not load: {type(e).__name__}: {e}"
        ) from e
