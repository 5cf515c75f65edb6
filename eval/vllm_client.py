"""vLLM as a bench method: a worker process in vLLM's own environment, spoken to over JSON lines.

vLLM's CPU build pins an older transformers than selfspec, so it runs in ``.venv-vllm`` (``make
vllm-env``) as ``vllm_worker.py``, one process per method (``vllm``, ``vllm-ngram``). A worker is
started by its method's first request (the bench's warm-up) and then sleeps on its stdin while the
bench runs the other methods; its stderr (vLLM's log) goes to ``<log_dir>/<method>.log``, whose tail a
one-line error quotes.

Idle CPU, measured on this 2-core machine (SmolLM2-135M, bf16, summing /proc/PID/task/*/stat): 1.4% of
one core per worker over 20 s between requests, and 0-3% (about 1.3% on average) in each 2 s while
selfspec's methods ran in a bench. Per thread (the 20 s one), all of it came from torch.distributed's
13 ``gloo_tcp_loop`` threads (vLLM makes its process groups even for a world of one): none busy-polls. vLLM's default
multiprocess engine idled as quietly, but gives the model one core of two (see ``vllm_worker.py``).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from selfspec.errors import SelfspecError

from .runs import Run

WORKER = Path(__file__).resolve().with_name("vllm_worker.py")
PYTHON_ENV = "SELFSPEC_VLLM_PYTHON"


def vllm_python() -> Path:
    """The vLLM environment's python: ``$SELFSPEC_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` in the current
    folder (where ``make vllm-env`` puts it: a clone's root)."""
    return Path(os.environ.get(PYTHON_ENV) or Path.cwd() / ".venv-vllm" / "bin" / "python")


def missing_environment() -> str | None:
    """Why vLLM cannot run here (one line), or None when its environment is in place."""
    python = vllm_python()
    if os.access(python, os.X_OK):
        return None
    return f"no vLLM environment at {python}; run `make vllm-env` (or set {PYTHON_ENV})"


def has_arctic_inference() -> bool:
    """Whether vLLM's environment has Arctic Inference's suffix trees (``make vllm-suffix``): what vLLM's own
    suffix decoding imports."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('arctic_inference') is None)"
    return subprocess.run([str(vllm_python()), "-c", probe], capture_output=True, check=False).returncode == 0


def depth_counts(drafts: int, accepted_per_pos: list[int]) -> tuple[list[int], list[int]]:
    """vLLM's chain counters as selfspec's (reached, accepted) per depth: a draft reaches depth d + 1 when its
    positions 0..d-1 were all accepted (vLLM accepts a prefix, so that is the count at position d - 1)."""
    reached = [drafts, *accepted_per_pos[:-1]]
    return reached, [int(a) for a in accepted_per_pos]


def with_acceptance(run: Run, reply: dict) -> Run:
    """``run`` with a speculative worker's counters in ``reply`` read as selfspec's per-depth acceptance and tau."""
    if "drafts" in reply:
        run.reached_depth, run.accepted_at_depth = depth_counts(int(reply["drafts"]), reply["accepted_per_pos"])
        run.tau = 1 + sum(run.accepted_at_depth) / run.reached_depth[0] if run.reached_depth[0] else None
    return run


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker loads: the model folder, its dtype (a torch dtype's name), its speculative config."""

    model: str
    dtype: str = "bfloat16"
    speculative: dict | None = None  # vllm.LLM(speculative_config=...)
    hf_overrides: dict | None = None  # vllm.LLM(hf_overrides=...): what the drafter needs the target's config to say
    threads: int = 0  # OpenMP threads (0: one per core)
    start_timeout_s: float = 900.0  # loading; a 1.5B model took ~1 minute here
    log_dir: str | None = None  # where <method>.log (the worker's stderr) goes; None: a temporary file

    def argv(self) -> list[str]:
        """The worker's command-line options."""
        out = ["--model", self.model, "--dtype", self.dtype, "--threads", str(self.threads)]
        out += ["--speculative-config", json.dumps(self.speculative)] if self.speculative else []
        return out + (["--hf-overrides", json.dumps(self.hf_overrides)] if self.hf_overrides else [])


class VllmClient:
    """One worker process: started on the first request, greedy requests in order, stopped by :meth:`close`."""

    def __init__(self, config: WorkerConfig, name: str = "vllm", python: str | Path | None = None) -> None:
        self.config, self.name = config, name
        self.python = Path(python) if python is not None else vllm_python()
        self.proc: subprocess.Popen | None = None
        self.log: Path | None = None
        self._buffer = b""

    def __enter__(self) -> VllmClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Launch the worker (once) and wait until its engine is loaded."""
        if self.proc is not None:
            return
        if self.config.log_dir is None:
            fd, log = tempfile.mkstemp(prefix=f"selfspec-{self.name}-", suffix=".log")
            os.close(fd)
        else:
            log = Path(self.config.log_dir) / f"{self.name}.log"
        self.log, self._buffer = Path(log), b""
        try:
            with self.log.open("wb") as stderr:
                self.proc = subprocess.Popen([str(self.python), str(WORKER), *self.config.argv()],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr)
        except OSError as exc:
            raise SelfspecError(f"{self.name}: cannot start the vLLM worker with {self.python}: {exc}") from exc
        atexit.register(self.close)
        reply = self._receive(self.config.start_timeout_s, "starting")
        if reply.get("ready") is not True:
            raise self._fail(f"answered {json.dumps(reply)[:200]} instead of ready")

    def run(self, ids: list[int], max_new: int) -> Run:
        """Greedy decoding of ``ids`` in vLLM: new tokens up to and including EOS, and the generate call's time."""
        self.start()
        self._send({"ids": [int(t) for t in ids], "max_new_tokens": int(max_new)})
        reply = self._receive(None, "generating")
        if "error" in reply:
            raise SelfspecError(f"{self.name}: the vLLM worker could not generate: {reply['error']}")
        try:
            return with_acceptance(Run([int(t) for t in reply["tokens"]], float(reply["seconds"])), reply)
        except (KeyError, TypeError, ValueError):
            raise self._fail(f"answered {json.dumps(reply)[:200]}, not tokens and seconds") from None

    def run_batch(self, batch: list[list[int]], max_new: int) -> tuple[list[list[int]], Run]:
        """Greedy decoding of every prompt of ``batch`` together (vLLM's continuous batching): the new tokens of
        each, and a Run of the batch's totals (the call's wall time; its acceptance, for a speculative worker)."""
        self.start()
        self._send({"batch": [[int(t) for t in ids] for ids in batch], "max_new_tokens": int(max_new)})
        reply = self._receive(None, "generating")
        if "error" in reply:
            raise SelfspecError(f"{self.name}: the vLLM worker could not generate: {reply['error']}")
        try:
            outputs = [[int(t) for t in out] for out in reply["outputs"]]
            return outputs, with_acceptance(Run([t for out in outputs for t in out], float(reply["seconds"])), reply)
        except (KeyError, TypeError, ValueError):
            raise self._fail(f"answered {json.dumps(reply)[:200]}, not outputs and seconds") from None

    def close(self, grace_s: float = 30.0) -> None:
        """End the worker: EOF on its stdin lets it exit by itself; killed if it has not within ``grace_s``."""
        atexit.unregister(self.close)
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()
            proc.wait(timeout=grace_s)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        proc.stdout.close()

    def _send(self, request: dict) -> None:
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self._died("generating") from None

    def _receive(self, timeout: float | None, doing: str) -> dict:
        """The next reply line as a dict; one-line errors for a dead, silent or garbled worker."""
        line = self._read_line(timeout, doing)
        try:
            reply = json.loads(line)
        except json.JSONDecodeError:
            reply = None
        if not isinstance(reply, dict):
            raise self._fail(f"answered {line[:200]!r}, which is not a JSON object")
        return reply

    def _read_line(self, timeout: float | None, doing: str) -> str:
        """Read the worker's stdout up to a newline (raw fd + select, so a timeout is possible)."""
        fd = self.proc.stdout.fileno()
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if not select.select([fd], [], [], left)[0]:
                raise self._fail(f"did not finish {doing} within {timeout:g} s")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise self._died(doing)
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode(errors="replace")

    def _died(self, doing: str) -> SelfspecError:
        """The worker exited: its exit code and the last lines of its stderr."""
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = "unknown"
        self.close(grace_s=0)
        return SelfspecError(f"{self.name}: the vLLM worker exited (code {code}) while {doing}: "
                             f"{self.stderr_tail()} (log: {self.log})")

    def _fail(self, what: str) -> SelfspecError:
        """The worker misbehaved: kill it, say what it did."""
        self.close(grace_s=0)
        return SelfspecError(f"{self.name}: the vLLM worker {what} (log: {self.log})")

    def stderr_tail(self, lines: int = 3) -> str:
        """The last non-empty lines of the worker's stderr, joined into one line."""
        if self.log is None or not self.log.exists():
            return "no stderr"
        with self.log.open("rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - 8192, 0))
            text = f.read().decode(errors="replace")
        tail = [s.strip() for s in text.splitlines() if s.strip()][-lines:]
        return " | ".join(tail)[-600:] or "no stderr"
