"""The command line every selfspec command shares: each option defined once, checked while it is parsed.

``selfspec generate``, ``demo`` and ``bench`` and ``python -m selfspec_eval.verify_cost`` add the groups
they take (model, decoding, sampling, drafting, heads path); flags map one to one onto ``load_model``
arguments and :class:`~selfspec.engine.DecodeConfig` fields. A value that cannot be right
(``--max-new-tokens -3``, ``--top-p 2``, a heads folder cut short) is refused by its type as the line
is parsed, before any model loads: one line on stderr and exit status 2 (:class:`OneLineParser`).

Where trained heads are looked for by default is decided here and only here (``--heads-path``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

from .errors import SelfspecError

HEADS_PATH_ENV = "SELFSPEC_HEADS_PATH"
DEFAULT_HEADS_PATH = "checkpoints"  # relative to the current folder: a clone's committed heads, from its root


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that reports a mistake as one line (``prog: error: ...``) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def run_command(prog: str, command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """``command(args)``'s exit status; a :class:`SelfspecError` becomes one line ``prog: error: ...`` and 2."""
    try:
        return command(args)
    except SelfspecError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


# --- types: each checks one value as the command line is parsed ---------------------------------------

def _number(cast: type, ok: Callable[[float], bool], what: str) -> Callable[[str], float]:
    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got '{text}'")
        return value

    return parse


positive_int = _number(int, lambda v: v >= 1, "an integer >= 1")
non_negative_int = _number(int, lambda v: v >= 0, "an integer >= 0")
non_negative_float = _number(float, lambda v: 0 <= v < math.inf, "a number >= 0")
positive_float = _number(float, lambda v: 0 < v < math.inf, "a number > 0")
probability = _number(float, lambda v: 0 < v <= 1, "a number in (0, 1]")


def _checked(check: Callable[[str], object]) -> Callable[[str], str]:
    """A type that runs ``check`` on the text (a SelfspecError is the argument's error) and keeps the text."""
    def parse(text: str) -> str:
        try:
            check(text)
        except SelfspecError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    return parse


def heads_folder(text: str) -> str:
    """A heads checkpoint folder whose JSON reads and whose weight files are whole (headers checked)."""
    from .checkpoint import check_heads_folder

    return _checked(check_heads_folder)(text)


def device(text: str) -> str:
    """A device this machine has (cpu, cuda, cuda:1, ...)."""
    from .zoo import check_device

    return _checked(check_device)(text)


def non_empty(text: str) -> str:
    """Any text but the empty one."""
    if not text:
        raise argparse.ArgumentTypeError("expected a non-empty string")
    return text


def folders(text: str) -> list[str]:
    """Folders separated by the system's path separator (':' on Linux), as absolute paths."""
    return [str(Path(p).expanduser().resolve()) for p in text.split(os.pathsep) if p]


# --- the groups ---------------------------------------------------------------------------------------

def target_passes(text: str) -> str:
    """``--target-pass`` of a command that times several side by side: names separated by commas."""
    from .target import BACKENDS

    names = text.split(",")
    bad = [n for n in names if n not in ("auto", *BACKENDS)]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown target pass {bad[0]!r}; choose from auto, {', '.join(BACKENDS)}")
    return text


def add_model_options(p: argparse.ArgumentParser, several_passes: bool = False) -> None:
    """--model, --dtype, --target-pass, --device, --threads: the target and how it runs (``several_passes``:
    --target-pass takes a comma-separated list)."""
    from .dtypes import DTYPE_CHOICES
    from .target import AUTO_BACKEND_HELP, BACKENDS
    from .zoo import DEFAULT_MODEL

    g = p.add_argument_group("model")
    g.add_argument("--model", default=DEFAULT_MODEL, help="the target: zoo name, local folder or hub id "
                   "(default: %(default)s)")
    g.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="auto: bfloat16 on GPUs and on CPUs that compute it natively and faster, else float32")
    how = ("how the target runs: eager modules over a growing cache, a static preallocated cache, or that static "
           "pass compiled (auto: " + AUTO_BACKEND_HELP + ")")
    if several_passes:
        g.add_argument("--target-pass", default="auto", type=target_passes,
                       help=how + "; several, separated by commas, are timed side by side")
    else:
        g.add_argument("--target-pass", default="auto", choices=("auto", *BACKENDS), help=how)
    g.add_argument("--exact", action=argparse.BooleanOptionalAction, default=True,
                   help="the static pass computes every row as a plain step does, so output is bit-identical to "
                        "plain decoding in any dtype, where this device's start-up self-test allows (default: on; "
                        "--no-exact: today's faster pass, bf16 outputs may differ at near-ties)")
    g.add_argument("--device", default="cpu", type=device, help="cpu, cuda, cuda:1, ...")
    g.add_argument("--threads", type=non_negative_int, default=0, help="torch CPU threads (0: torch's default)")


def load_target(args: argparse.Namespace):
    """(model, tokenizer) as the model options say."""
    import torch

    from .zoo import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    return load_model(args.model, dtype=args.dtype, device=args.device)


def add_decoding_options(p: argparse.ArgumentParser, max_new_tokens: int = 128) -> None:
    """--max-new-tokens, --max-depth, --max-nodes, --fixed-tree: how long the answer, how large the drafts."""
    g = p.add_argument_group("decoding")
    g.add_argument("--max-new-tokens", type=positive_int, default=max_new_tokens,
                   help="new tokens at most (a benchmark: per turn; default: %(default)s)")
    g.add_argument("--max-depth", type=non_negative_int, default=16,
                   help="deepest draft (the adaptive controller picks up to this)")
    g.add_argument("--max-nodes", type=positive_int, default=16, help="largest draft tree, root included")
    g.add_argument("--fixed-tree", "--no-adaptive", dest="fixed_tree", action="store_true",
                   help="draft --max-depth levels (--max-nodes nodes) at every step instead of letting the adaptive "
                        "controller pick the depth or step plain: the drafter's own acceptance (tau), the way "
                        "papers report it")


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    """--temperature, --top-k, --top-p, --seed, --stop: lossless sampling (greedy by default) and stops."""
    g = p.add_argument_group("sampling (speculative sampling keeps the target's distribution exactly)")
    g.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=non_negative_int, default=0, help="0 = off")
    g.add_argument("--top-p", type=probability, default=1.0, help="in (0, 1]; 1.0 = off")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", type=non_empty, help="stop string (repeatable)")


def decode_config(args: argparse.Namespace):
    """The :class:`~selfspec.engine.DecodeConfig` of the decoding options, and of the sampling options when
    the command takes them (greedy otherwise)."""
    from .engine import DecodeConfig
    from .sampling import SamplingConfig

    sampling = {}
    if "temperature" in args:
        sampling = {"sampling": SamplingConfig(args.temperature, args.top_k, args.top_p), "seed": args.seed,
                    "stop_strings": tuple(args.stop or ())}
    return DecodeConfig(max_new_tokens=args.max_new_tokens, max_depth=args.max_depth, max_nodes=args.max_nodes,
                        adaptive=not args.fixed_tree, **sampling)


def add_drafter_options(p: argparse.ArgumentParser, several_heads: bool = False) -> None:
    """--draft-model, --heads (one, or repeatable), --no-lookup: what drafts beside prompt lookup."""
    g = p.add_argument_group("drafting")
    g.add_argument("--draft-model", help="a separate draft model sharing the target's tokenizer: zoo name, "
                   "folder or hub id")
    heads_help = "a selfspec heads checkpoint folder"
    if several_heads:
        g.add_argument("--heads", action="append", default=[], type=heads_folder, metavar="FOLDER",
                       help=heads_help + " (repeatable), beside the model's heads found on --heads-path")
    else:
        g.add_argument("--heads", type=heads_folder, metavar="FOLDER", help=heads_help)
    g.add_argument("--no-lookup", action="store_true",
                   help="draft with the heads or draft model alone (default: prompt lookup first where the context "
                        "repeats itself, the heads or draft model elsewhere, each judged on its own acceptance)")
    g.add_argument("--suffix-max-mib", type=positive_float, default=64, metavar="MIB",
                   help="--drafter suffix: the most its index of earlier requests holds, the oldest forgotten first "
                        "(default: %(default)s; ~210 bytes a token: 64 MiB hold ~300k tokens); its size in serve's "
                        "/metrics (selfspec_suffix_index{part=\"bytes\"})")


def add_heads_path_option(p: argparse.ArgumentParser) -> None:
    """--heads-path: where a model's trained heads (``<model>-<family>`` folders) are looked for."""
    p.add_argument("--heads-path", type=folders, metavar="DIRS",
                   default=os.environ.get(HEADS_PATH_ENV) or DEFAULT_HEADS_PATH,
                   help=f"folders holding <model>-<family> heads checkpoints, separated by '{os.pathsep}' "
                        f"(default: ${HEADS_PATH_ENV} if set, else ./{DEFAULT_HEADS_PATH}, a clone's committed "
                        "heads: run from the clone's root)")
