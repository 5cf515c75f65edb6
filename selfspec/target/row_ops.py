"""The decoder loop's per-row operations as one C++ call each (``selfspec/target/csrc/row_ops.cpp``).

The model's RMS norm is 8 torch operators, rotary positions 6 per tensor, the gated activation 2, each a dispatch
and a pass over memory; on a 2-core CPU a 16-row step of SmolLM2-135M spent ~10 ms of ~50 in them. Here each is one
call computing row by row, rounding where the modules round: rotary positions and residual adds give torch's bits,
the norm's sum of squares and silu's exp may differ in their last float bit (a fixed order of their own), so a model
run through these differs from its own forward by rounding only, and every row's bits are independent of the call.

    ops()   the built extension (rms_norm, add_rms_norm_, rope_, silu_mul), or None where it cannot be built (or
            ``SELFSPEC_ROW_OPS=0``): the loop then calls the model's own modules
"""

from __future__ import annotations

import functools
import os

from . import extension

NAME = "selfspec_row_ops"


@functools.cache
def ops():
    """The built extension, or None where it is off or cannot be built here (said once)."""
    if os.environ.get("SELFSPEC_ROW_OPS", "1") == "0":
        return None
    return extension.load_kernel(NAME, "row_ops.cpp", "row operations of the decoder loop",
                                 "the loop calls the model's own norm, rotary and activation modules",
                                 cflags=("-ffp-contract=off",))  # products rounded apart from sums, as torch does
