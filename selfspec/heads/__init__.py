"""Draft heads on a frozen target: EAGLE-3-style, EAGLE-style, Medusa-style and early exit, one registry for all.

Each family is a config dataclass (``config.py``), a module holding only the trained weights, and a
:class:`~selfspec.drafters.base.Drafter` that joins the module to the target's frozen embeddings,
layers, norm and LM head. ``init_heads`` makes an untrained module; ``selfspec.checkpoint`` (above this
package: nothing here imports it) saves and loads trained ones.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn
from transformers import PretrainedConfig

from ..drafters.base import Drafter
from .common import placement
from .config import HeadConfig, config_class, make_config
from .eagle import EagleHead
from .eagle3 import Eagle3Head
from .eagle_drafter import Eagle3Drafter, EagleDrafter
from .early_exit import EarlyExitDrafter, ExitAdapter
from .medusa import MedusaDrafter, MedusaHeads


class Family(NamedTuple):
    """One head family: its trained module, its drafter, and the module holding its training objective (target
    states, loss, per-depth predictions; imported when training: see ``selfspec/train/losses.py``). Its config
    dataclass registers itself by the same name (``config.CONFIGS``)."""

    module: type[nn.Module]
    drafter: type[Drafter]
    objective: str


# the registry; the strongest drafter first: commands that find several heads for a model list them in this order
FAMILIES: dict[str, Family] = {
    "eagle3": Family(Eagle3Head, Eagle3Drafter, "selfspec.train.eagle3"),
    "eagle": Family(EagleHead, EagleDrafter, "selfspec.train.eagle"),
    "medusa": Family(MedusaHeads, MedusaDrafter, "selfspec.train.medusa"),
    "early-exit": Family(ExitAdapter, EarlyExitDrafter, "selfspec.train.early_exit"),
}


def build_heads(config: HeadConfig, target_config: PretrainedConfig, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> nn.Module:
    """An untrained head module of ``config``'s family shaped for a target with ``target_config``."""
    config = config.resolved(target_config)
    with torch.device(device):
        module = FAMILIES[config.family].module(config, target_config)
    return module.to(dtype=dtype)


def init_heads(family: str, base_model: nn.Module, **hyperparams: Any) -> nn.Module:
    """Untrained heads of ``family`` for ``base_model`` (on its device, in its dtype); see ``config.py`` for options."""
    config = make_config(family, **hyperparams)
    device, dtype = placement(base_model)
    return build_heads(config, base_model.config, device, dtype)


def make_drafter(heads: nn.Module, base_model: nn.Module) -> Drafter:
    """The engine drafter joining ``heads`` to its frozen ``base_model``."""
    return FAMILIES[heads.config.family].drafter(base_model, heads)


__all__ = ["FAMILIES", "build_heads", "config_class", "init_heads", "make_drafter",
           "Eagle3Head", "Eagle3Drafter", "EagleHead", "EagleDrafter", "ExitAdapter", "EarlyExitDrafter", "MedusaHeads", "MedusaDrafter"]
