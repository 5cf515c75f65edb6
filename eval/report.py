"""The benchmark's outputs: ``report.json`` (everything), ``report.md`` (tables), PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

from selfspec.divergence import format_counts
from selfspec.memory import format_bytes

from .environment import caption
from .metrics import OVERALL


def _fmt(x, spec: str = ".2f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def divergence_lines(report: dict) -> list[str]:
    """The losslessness check: verdict counts per method, then every output that is not identical."""
    div = report.get("divergence")
    if div is None:
        return []
    ref, table = div["reference"], report["summary"]["categories"][OVERALL]
    lines = [f"## Outputs against `{ref}` ({div['dtype']})", "",
             f"Each output that differs from `{ref}`'s is checked at its first differing token: the target's "
             "next-token logits there are recomputed in float32. *near-tie*: both tokens lie within rounding of "
             "the float32 top logit (bound: the largest error of the run's dtype on the top tokens at that "
             f"prefix, x2 for opposite signs, x{div['safety']:g} safety; `selfspec/divergence.py`), so rounding may "
             "pick either; *real*: anything else, a bug.", "",
             "| method | diagnosis |", "|---|---|"]
    lines += [f"| {m} | {format_counts(v['divergence'])} |" for m, v in table.items() if m != ref and "divergence" in v]
    if div["diagnoses"]:
        lines += ["", f"| question | method | new token | `{ref}` took | method took | float32 logits (`{ref}`'s, "
                  "method's, top) | its rank (1 = top) | gap | bound | verdict |", "|---" * 10 + "|"]
        for d in div["diagnoses"]:
            logits = "-" if d["gap"] is None else (f"{d['reference_logit']:.3f}, {d['other_logit']:.3f}, "
                                                   f"{d['top_logit']:.3f}")
            lines.append(f"| {d['prompt']} | {d['method']} | {_fmt(d['index'], 'd')} | "
                         f"{_fmt(d['reference_token'], 'd')} | {_fmt(d['other_token'], 'd')} | {logits} | "
                         f"{_fmt(d['other_rank'], 'd')} | {_fmt(d['gap'], '.3g')} | {_fmt(d['bound'], '.3g')} | "
                         f"**{d['verdict']}** |")
    return lines + [""]


def _dtype_pass(setup: dict) -> str:
    """'bfloat16 (--dtype auto), static target pass' from a run's setup (older reports lack the *_used keys)."""
    used = setup.get("dtype_used", setup["dtype"])
    text = f"{used} (--dtype auto)" if setup["dtype"] == "auto" and used != "auto" else used
    exact = " (exact)" if setup.get("exact") else ""
    return f"{text}, {setup['target_pass_used']}{exact} target pass" if setup.get("target_pass_used") else text


def markdown(report: dict) -> str:
    """Tables: overall and per category (tokens/s, speedup, tau, identical), the divergence check, memory,
    budgets."""
    s, setup = report["summary"], report["setup"]
    lines = [f"# selfspec bench: {setup['model']}", "",
             f"{s['questions']} questions, {setup['max_new_tokens']} new tokens, greedy, {_dtype_pass(setup)}, "
             f"{setup['device']}; methods interleaved per question after a warm-up. Speedup is against "
             f"`{s['baseline']}`; identical = greedy output equal to "
             f"`{(report.get('divergence') or {}).get('reference', s['baseline'])}`'s.", "",
             f"Measured: {caption(report.get('environment'))}.", ""]
    if "draft-model" in s["categories"][OVERALL] and not setup.get("no_lookup"):
        lines += ["selfspec `draft-model` drafts by prompt lookup where the context repeats itself (an n-gram of "
                  "3+ tokens seen before) and with the draft model elsewhere (`--no-lookup`: the draft model alone).", ""]
    if setup.get("fixed_tree"):
        lines += [f"`--fixed-tree`: selfspec methods draft {setup['max_depth']} levels ({setup['max_nodes']} nodes) at "
                  "every step, without the adaptive controller: tau is the drafters' own acceptance, and tokens/s "
                  "what that costs when every step drafts.", ""]
    if any(m.endswith("+lookup") for m in s["categories"][OVERALL]):
        lines += ["`<heads>+lookup`: the same heads, drafting by prompt lookup where the context repeats itself "
                  "and with the heads elsewhere.", ""]
    cats = s["categories"]
    for cat in [OVERALL, *[c for c in cats if c != OVERALL]]:
        table = cats[cat]
        n = next(iter(table.values()))["questions"]
        lines += [f"## {cat} ({n} questions)", "",
                  "| method | tokens/s | speedup | tau | identical | acceptance by depth (1..4) |",
                  "|---|---|---|---|---|---|"]
        for m, v in table.items():
            acc = " ".join(f"{a:.2f}" for a in v["acceptance_by_depth"][:4]) or "-"
            lines.append(f"| {m} | {v['tokens_per_s']:.2f} | {_fmt(v['speedup'])}x | {_fmt(v['tau'])} | "
                         f"{v.get('identical', '-')}/{v['questions']} | {acc} |")
        lines.append("")
    lines += divergence_lines(report)
    lines += ["## Memory added over the target alone", "",
              f"Target: {format_bytes(report['target_memory']['weights'])} of weights, "
              f"{format_bytes(report['target_memory']['kv_per_token'])} of KV cache per token.", "",
              "| method | predicted weights | predicted KV / token | predicted tree | predicted at "
              f"{setup['context']} tokens | measured | measured how |", "|---|---|---|---|---|---|---|"]
    for m, mem in report["memory"].items():
        p, meas = mem["predicted"], mem["measured"]
        lines.append(f"| {m} | {format_bytes(p['weights'])} | {format_bytes(p['kv_per_token'])} | "
                     f"{format_bytes(p['transient'])} | {format_bytes(mem['predicted_at_context'])} | "
                     f"{format_bytes(meas['total'])} | {meas['source']} |")
    if report.get("budgets"):
        lines += ["", f"## Memory budgets (context {setup['context']} tokens)", "",
                  "| budget | method | needed | fits | longest context that fits | tokens/s there | measured at |",
                  "|---|---|---|---|---|---|---|"]
        for b in report["budgets"]:
            speed = b.get("speed")
            there = "-" if not speed else (speed.get("error") or f"{speed['tokens_per_s']:.2f}")
            at = "-" if not speed else f"{speed['context']} tokens"
            lines.append(f"| {format_bytes(b['budget'])} | {b['method']} | {format_bytes(b['needed'])} | "
                         f"{'yes' if b['fits'] else 'no'} | {b['max_context']} | {there} | {at} |")
    return "\n".join(lines) + "\n"


def _save(fig, path: Path) -> Path:
    """Lay out, write and close one figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plots(report: dict, folder: Path) -> list[Path]:
    """speedup per category per method; speedup against added memory; acceptance per depth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = report["summary"]["categories"]
    methods = list(cats[OVERALL])
    names = [c for c in cats if c != OVERALL] + [OVERALL]
    out = []

    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(methods) * len(names) / 2, 4))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        ax.bar([c + i * width for c in range(len(names))], [cats[c][m]["speedup"] or 0 for c in names], width,
               label=m)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([c + 0.4 - width / 2 for c in range(len(names))], names)
    ax.set_ylabel(f"speedup vs {report['summary']['baseline']}")
    ax.set_title(f"{report['setup']['model']}: speedup by category")
    ax.legend(fontsize=8)
    out.append(_save(fig, folder / "speedup_by_category.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in methods:
        mib = report["memory"][m]["predicted_at_context"] / 2**20
        ax.scatter([max(mib, 1e-2)], [cats[OVERALL][m]["speedup"] or 0], s=40)
        ax.annotate(m, (max(mib, 1e-2), cats[OVERALL][m]["speedup"] or 0), fontsize=8, xytext=(4, 4),
                    textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel(f"memory added over the target (MiB, predicted at {report['setup']['context']} tokens)")
    ax.set_ylabel("overall speedup")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_title("speedup against added memory")
    out.append(_save(fig, folder / "speedup_vs_memory.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in methods:
        acc = cats[OVERALL][m]["acceptance_by_depth"]
        if acc:
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=m)
    ax.set_xlabel("draft depth")
    ax.set_ylabel("P(accepted | reached)")
    ax.set_ylim(0, 1)
    ax.set_title("acceptance per depth (all questions)")
    if ax.lines:
        ax.legend(fontsize=8)
    out.append(_save(fig, folder / "acceptance_by_depth.png"))
    return out


def write(report: dict, folder: Path, with_plots: bool = True) -> list[Path]:
    """report.json, report.md and (matplotlib permitting) the plots; returns the files written."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps(report, indent=2))
    (folder / "report.md").write_text(markdown(report))
    files = [folder / "report.json", folder / "report.md"]
    if with_plots:
        files += plots(report, folder)
    return files
