"""Draft heads on a frozen target: EAGLE-3-style, EAGLE-style, Medusa-style and early exit, one registry for all.

Each family is a config dataclass (``config.py``), a module holding only the trained weights, a
:class:`~selfspec.drafters.base.Drafter` that joins the module to the target's frozen embeddings,
layers, norm and LM head, and its training objective (``selfspec/objectives/<family>.py``), registered together by one
:func:`register_family` call, as peft registers a method. ``init_heads`` makes an untrained module;
``selfspec.checkpoint`` (above this package: nothing here imports it) saves and loads trained ones.

The registry imports the objectives (``selfspec.objectives.<family>``, torch and ``selfspec.frozen`` only, none of
this package) so that a family is whole, and checked, the moment it registers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch
from torch import nn
from transformers import PretrainedConfig

from ..drafters.base import Drafter
from ..errors import SelfspecError
from ..frozen import placement
from ..objectives import eagle as eagle_objective
from ..objectives import eagle3 as eagle3_objective
from ..objectives import early_exit as early_exit_objective
from ..objectives import medusa as medusa_objective
from ..objectives.common import Objective
from .config import CONFIGS, FamilyConfig, HeadConfig, config_class, make_config
from .config import EagleConfig, EarlyExitConfig, MedusaConfig
from .eagle import EagleHead
from .eagle3 import Eagle3Config, Eagle3Head
from .eagle_drafter import Eagle3Drafter, EagleDrafter
from .early_exit import EarlyExitDrafter, ExitAdapter
from .medusa import MedusaDrafter, MedusaHeads


class Family(NamedTuple):
    """One head family: its config dataclass, its trained module, its drafter and its training objective."""

    config: type[FamilyConfig]
    module: type[nn.Module]
    drafter: type[Drafter]
    objective: Objective


# the registry, in registration order: the strongest drafter first (commands that find several heads list them so)
FAMILIES: dict[str, Family] = {}


def register_family(name: str, *, config: type, module: type, drafter: type, objective: Objective) -> None:
    """Make a head family known by ``name``: config, module, drafter and objective in one call, each checked now.

    A name registered twice, a config that is not a dataclass answering to ``name``, a module that is not an
    ``nn.Module``, a drafter that is not a :class:`Drafter`, or an objective missing a part is an error here, not
    at first use. (The objectives, ``selfspec/objectives/<family>.py``, import torch and the target helpers only.)"""
    problems = []
    if name in FAMILIES:
        problems.append("already registered")
    if not (isinstance(config, type) and dataclasses.is_dataclass(config) and issubclass(config, FamilyConfig)
            and getattr(config, "family", None) == name):
        problems.append(f"config must be a FamilyConfig dataclass whose family is '{name}'")
    if not (isinstance(module, type) and issubclass(module, nn.Module)):
        problems.append("module must be an nn.Module class")
    if not (isinstance(drafter, type) and issubclass(drafter, Drafter)):
        problems.append("drafter must be a Drafter class")
    if not isinstance(objective, Objective):
        problems.append("objective must be a selfspec.objectives.common.Objective")
    elif objective.missing():
        problems.append(f"objective lacks {', '.join(objective.missing())}")
    if problems:
        raise SelfspecError(f"cannot register head family '{name}': {'; '.join(problems)}")
    FAMILIES[name] = Family(config, module, drafter, objective)
    CONFIGS[name] = config


register_family("eagle3", config=Eagle3Config, module=Eagle3Head, drafter=Eagle3Drafter,
                objective=eagle3_objective.OBJECTIVE)
register_family("eagle", config=EagleConfig, module=EagleHead, drafter=EagleDrafter,
                objective=eagle_objective.OBJECTIVE)
register_family("medusa", config=MedusaConfig, module=MedusaHeads, drafter=MedusaDrafter,
                objective=medusa_objective.OBJECTIVE)
register_family("early-exit", config=EarlyExitConfig, module=ExitAdapter, drafter=EarlyExitDrafter,
                objective=early_exit_objective.OBJECTIVE)


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


__all__ = ["FAMILIES", "Family", "register_family", "build_heads", "config_class", "init_heads", "make_drafter",
           "Eagle3Head", "Eagle3Drafter", "EagleHead", "EagleDrafter", "ExitAdapter", "EarlyExitDrafter", "MedusaHeads",
           "MedusaDrafter"]
