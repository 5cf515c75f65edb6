"""The report of ``python -m selfspec_eval.gpu_check``: where it ran, then each step, as JSON and Markdown."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path


def git_commit() -> str:
    """The clone's commit, ``+dirty`` when tracked files changed since; "unknown" outside a clone."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit.strip() + ("+dirty" if dirty.strip() else "")


def environment(size: str) -> dict:
    """The machine, torch and commit a check ran on."""
    import torch

    cuda = torch.cuda.is_available()
    return {"size": size, "device": torch.cuda.get_device_name(0) if cuda else f"cpu ({os.cpu_count()} cores)",
            "cuda": torch.version.cuda if cuda else None, "torch": torch.__version__,
            "python": platform.python_version(), "git_commit": git_commit(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def _value(x) -> str:
    return "-" if x is None else str(x)


def figure_lines(figures: dict) -> list[str]:
    """A step's figures: a bench's methods as a table, everything else as a list."""
    lines = [f"- {k}: {_value(v)}" for k, v in figures.items() if k != "methods"]
    methods = figures.get("methods")
    if methods:
        lines += ["", f"| method | tokens/s | speedup vs {figures.get('speedup_against', '-')} | tau | outputs |",
                  "|---|---|---|---|---|"]
        for name, m in methods.items():
            outputs = m["outputs"]
            diag = "-" if not outputs else ", ".join(f"{n} {k}" for k, n in outputs.items())
            lines.append(f"| {name} | {m['tokens_per_s']} | {m['speedup']}x | {_value(m['tau'])} | {diag} |")
    return lines


def markdown(env: dict, results: list[dict], total_s: float) -> str:
    """The whole report as Markdown: a summary table, then one section per step."""
    lines = ["# selfspec gpu-check", "",
             f"{env['size']} size on **{env['device']}** (CUDA {_value(env['cuda'])}), torch {env['torch']}, "
             f"Python {env['python']}, commit `{env['git_commit']}`, started {env['started']}, "
             f"{total_s:.0f} s in all.", "",
             "| step | status | seconds | note |", "|---|---|---|---|"]
    lines += [f"| {r['name']} | **{r['status']}** | {r['seconds']:.0f} | {r['note']} |" for r in results]
    for r in results:
        lines += ["", f"## {r['name']}: {r['status']}", ""]
        if r["note"]:
            lines += [r["note"], ""]
        if r["commands"]:
            lines += ["```", *r["commands"], "```", "", f"Return code {_value(r['returncode'])}, "
                      f"{r['seconds']:.1f} s.", ""]
        lines += figure_lines(r["figures"])
        if r["tail"]:
            lines += ["", "<details><summary>end of its output</summary>", "", "```", *r["tail"], "```", "",
                      "</details>"]
    return "\n".join(lines) + "\n"


def write_report(out: Path, env: dict, results: list[dict], total_s: float) -> list[Path]:
    """``out/report.json`` and ``out/report.md``; returns their paths."""
    data = {**env, "total_s": round(total_s, 1),
            "ok": not any(r["status"] in ("failed", "timed out") for r in results), "steps": results}
    paths = [out / "report.json", out / "report.md"]
    paths[0].write_text(json.dumps(data, indent=2) + "\n")
    paths[1].write_text(markdown(env, results, total_s))
    return paths
