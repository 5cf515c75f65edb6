"""Attaching the heads of a folder to a frozen base: strict about the base and about every tensor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..drafters.base import Drafter
from ..errors import SelfspecError
from ..heads import build_heads, make_drafter
from ..frozen import placement
from ..heads.config import config_from_dict
from .format import check_heads_folder, read_tensors
from .identity import base_identity, check_base


def _check_tensors(module: nn.Module, tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """One error listing every missing, unexpected or misshapen tensor."""
    want = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    problems = []
    if missing := sorted(set(want) - set(got)):
        problems.append(f"missing {missing}")
    if unexpected := sorted(set(got) - set(want)):
        problems.append(f"unexpected {unexpected}")
    wrong = [f"{k}: file {got[k]} vs expected {want[k]}" for k in sorted(set(want) & set(got)) if want[k] != got[k]]
    if wrong:
        problems.append(f"wrong shapes {wrong}")
    if problems:
        raise SelfspecError(f"the weights in {folder} do not match its {module.config.family} config: "
                            f"{'; '.join(problems)}")


def load_heads(base: nn.Module | str, folder: str | Path, tokenizer=None) -> tuple[nn.Module, Drafter]:
    """Attach the heads in ``folder`` to ``base`` (a loaded model, or a zoo name / folder / hub id to load).

    Returns (heads module, drafter); with a name, the loaded base is ``drafter.target``. The folder's
    files are checked before a named base is loaded.
    """
    folder = Path(folder)
    meta = check_heads_folder(folder)
    if isinstance(base, str):
        from ..zoo import load_model

        base, loaded_tokenizer = load_model(base)
        tokenizer = tokenizer if tokenizer is not None else loaded_tokenizer
    check_base(meta["base"], base_identity(base, tokenizer), folder)
    config = config_from_dict(meta["family"], meta["config"])
    device, dtype = placement(base)
    heads = build_heads(config, base.config, device, dtype)
    tensors = read_tensors(folder)
    _check_tensors(heads, tensors, folder)
    heads.load_state_dict(tensors, strict=True)
    heads.eval().requires_grad_(False)
    return heads, make_drafter(heads, base)


def load_augmented(folder: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
                   ) -> tuple[nn.Module, Any, Drafter]:
    """Load a merged folder (``save_merged``): (base model, tokenizer, drafter)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise SelfspecError(f"{folder} holds heads only (no base config.json): use load_heads(base, folder)")
    check_heads_folder(folder)
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder) if (folder / "tokenizer_config.json").is_file() else None
    except OSError as exc:
        raise SelfspecError(f"could not load the base model in {folder}: {str(exc).splitlines()[0]}") from exc
    model.requires_grad_(False)
    _, drafter = load_heads(model, folder, tokenizer)
    return model, tokenizer, drafter
