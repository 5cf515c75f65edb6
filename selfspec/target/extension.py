"""Building selfspec's C++ kernels (``selfspec/target/csrc/``) for this CPU at first use.

torch's C++ extension loader compiles a source with ``-march=native`` (a C++ compiler and ninja; 20-40 s once) and
caches the library under ``$TORCH_EXTENSIONS_DIR`` or ~/.cache/torch_extensions. Its name carries this CPU's model and
flags: a build from one host would run (or crash with an illegal instruction) on another sharing that folder.
"""

from __future__ import annotations

import logging
import os
from importlib.resources import as_file, files
from pathlib import Path

from ..cpu import flags_digest

log = logging.getLogger(__name__)


def build_name(name: str) -> str:
    """``name`` as built for this CPU (its model and flags)."""
    return f"{name}_{flags_digest()}"


def load_kernel(name: str, source: str, what: str, instead: str, openmp: bool = False, cflags: tuple[str, ...] = ()):
    """``csrc/<source>`` built as ``build_name(name)`` (once per CPU), or None where it cannot be built here (said in
    one line naming ``what`` it is and what runs ``instead``)."""
    try:
        from torch.utils.cpp_extension import get_default_build_root, load

        root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
        if not any(root.glob(f"**/{build_name(name)}/*.so")):
            log.warning("building selfspec's %s for this CPU (once, 20-40 s; cached in %s)", what, root)
        omp = ["-fopenmp"] if openmp else []
        with as_file(files("selfspec.target") / "csrc" / source) as path:  # package data
            return load(name=build_name(name), sources=[str(path)], verbose=False,
                        extra_cflags=["-O3", "-march=native", *omp, *cflags], extra_ldflags=omp)
    except Exception as err:  # noqa: BLE001 - any build failure means: run without it
        log.warning("%s unavailable (%s); %s", what, str(err).strip().splitlines()[-1] if str(err).strip()
                    else type(err).__name__, instead)
        return None
