"""The documents cannot drift from the code: every command they show, and every link, is checked.

Each shell command in a fenced code block of the checked documents that runs ``selfspec``,
``python -m selfspec_eval.<module>``, ``python training/<script>.py``, ``accelerate launch
training/<script>.py``, ``torchrun ... training/<script>.py`` or ``make <target>`` is compared with the
real argument parser: the subcommand exists, every ``--flag`` is one of its options, the script or
module file exists, the make target is defined. Nothing runs and no model loads: the parsers are
built (``selfspec``'s by ``selfspec_cli.main.build_parser``; a script's or module's by calling its
``main()`` with ``parse_args`` stopped before it returns) and only their option strings are read.
Every relative Markdown link must name a file or folder that exists, and a ``#fragment`` into a
Markdown file must name one of its headings.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
import re
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted(p for p in {ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "training" / "README.md",
                          ROOT / "eval" / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("checkpoints/**/README.md")}
              if p.is_file())
SHELL_FENCES = {"", "bash", "sh", "shell", "console"}
SEPARATORS = {"&&", "||", ";", "|"}


# --- commands in fenced blocks -------------------------------------------------------------------

def fenced_blocks(text: str) -> Iterator[tuple[int, str, str]]:
    """(first line number, info string, body) of every ``` fenced block."""
    lines, i = text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^\s*(`{3,})\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        fence, info, start, body = m.group(1), m.group(2).lower(), i + 1, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        i += 1
        yield start + 1, info, "\n".join(body)


def shell_commands(body: str) -> Iterator[list[str]]:
    """The commands of a shell block as token lists: continuations joined, comments dropped, split at
    ``&&``, ``||``, ``;`` and ``|``, a leading ``$ `` prompt removed."""
    for line in body.replace("\\\n", " ").splitlines():
        line = re.sub(r"^\s*\$\s+", "", line)
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:  # not shell (an unbalanced quote in prose or JSON)
            continue
        command: list[str] = []
        for tok in tokens + [";"]:
            if tok in SEPARATORS:
                if command:
                    yield command
                command = []
            else:
                command.append(tok)


def doc_commands(path: Path) -> Iterator[tuple[int, list[str]]]:
    """(line, tokens) of every shell command in the shell-like fenced blocks of ``path``."""
    for line, info, body in fenced_blocks(path.read_text(encoding="utf-8")):
        if info in SHELL_FENCES:
            for command in shell_commands(body):
                yield line, command


# --- the parsers ---------------------------------------------------------------------------------

class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


@contextlib.contextmanager
def _stop_at_parse() -> Iterator[None]:
    """Make every ArgumentParser raise itself instead of parsing: ``main()`` stops before it runs."""
    def stop(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> argparse.Namespace:
        raise _Captured(self)

    saved = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_known_args = stop
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = saved


def _capture(main: Callable[[], object]) -> argparse.ArgumentParser | None:
    """The parser ``main()`` builds, or None when it builds none without failing first."""
    with _stop_at_parse():
        try:
            main()
        except _Captured as captured:
            return captured.parser
        except (Exception, SystemExit):
            return None
    return None


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of ``parser`` and of its subcommands' parsers."""
    found: set[str] = set()
    for action in parser._actions:
        found.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= option_strings(sub)
    return found


@functools.lru_cache(maxsize=None)
def selfspec_parser() -> argparse.ArgumentParser:
    """The ``selfspec`` command's real parser (building it loads no model)."""
    from selfspec_cli.main import build_parser

    return build_parser()


@functools.lru_cache(maxsize=None)
def script_options(path: Path) -> tuple[frozenset[str] | None, str]:
    """(option strings of the script's parser, or None when it cannot be built cheaply; its source)."""
    spec = importlib.util.spec_from_file_location(f"_doc_check_{path.stem.replace('-', '_')}", path)

    def load():
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return _parser_options(load, path.read_text(encoding="utf-8"))


def _parser_options(load, source: str) -> tuple[frozenset[str] | None, str]:
    """(option strings of the parser the loaded module's ``main`` builds, or None; ``source``)."""
    try:
        module = load()
    except Exception:
        return None, source
    main = getattr(module, "main", None)
    parser = _capture(main) if callable(main) else None
    return (frozenset(option_strings(parser)) if parser else None), source


@functools.lru_cache(maxsize=None)
def module_options(name: str) -> tuple[frozenset[str] | None, str]:
    """The same for ``python -m NAME`` (an installed module: selfspec_eval.*)."""
    spec = importlib.util.find_spec(name)
    return _parser_options(lambda: importlib.import_module(name), Path(spec.origin).read_text(encoding="utf-8"))


@functools.lru_cache(maxsize=None)
def make_targets() -> frozenset[str]:
    """The Makefile's targets."""
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return frozenset(t for line in re.findall(r"^([\w .$()/-]+?)\s*:(?!=)", text, re.M) for t in line.split())


def _flags(tokens: list[str]) -> list[str]:
    """The ``--flag`` / ``-f`` tokens of a command (``--flag=value`` cut at ``=``; a quoted value that
    holds spaces, such as serve_load's ``--server "--drafter none"``, is a value, not a flag)."""
    return [t.split("=", 1)[0] for t in tokens if re.match(r"^--?[A-Za-z][\w-]*(=|$)", t)]


def _unknown(flags: list[str], options: frozenset[str] | None, source: str) -> list[str]:
    if options is not None:
        return [f for f in flags if f not in options]
    return [f for f in flags if not re.search(rf"[\"']{re.escape(f)}[\"'=]", source)]  # grep fallback


def check_command(tokens: list[str]) -> list[str] | None:
    """What is wrong with one documented command (empty when nothing), or None when it is not ours."""
    if tokens and tokens[0] == "make":
        missing = [t for t in tokens[1:] if "=" not in t and not t.startswith("-") and t not in make_targets()]
        return [f"no make target {t}" for t in missing]
    if tokens and tokens[0] == "selfspec":
        return check_selfspec(tokens[1:])
    python = tokens and re.fullmatch(r"(\S*/)?python3?", tokens[0])
    if python and len(tokens) > 2 and tokens[1] == "-m" and tokens[2].startswith("selfspec_eval."):
        name = tokens[2]
        if importlib.util.find_spec(name) is None:
            return [f"no module {name}"]
        return [f"{name} has no option {f}" for f in _unknown(_flags(tokens[3:]), *module_options(name))]
    if python or (tokens and tokens[0] in ("accelerate", "torchrun")):
        scripts = [i for i, t in enumerate(tokens) if t.startswith("training/") and t.endswith(".py")]
        if not scripts:
            return None
        i = scripts[0]
        path = ROOT / tokens[i]
        if not path.is_file():
            return [f"no script {tokens[i]}"]
        return [f"{tokens[i]} has no option {f}" for f in _unknown(_flags(tokens[i + 1:]), *script_options(path))]
    return None


def check_selfspec(args: list[str]) -> list[str]:
    """A ``selfspec`` command line against the real parser: its subcommand(s) and options."""
    parser: argparse.ArgumentParser = selfspec_parser()
    rest, path = list(args), ["selfspec"]
    while True:  # walk down subcommands (selfspec models fetch NAME)
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            break
        positional = next((t for t in rest if not t.startswith("-")), None)
        if positional is None or positional not in subs[0].choices:
            return [f"{' '.join(path)}: no subcommand {positional!r}"]
        parser = subs[0].choices[positional]
        path.append(positional)
        rest = rest[rest.index(positional) + 1:]
    options = frozenset(option_strings(parser))
    return [f"{' '.join(path)} has no option {f}" for f in _flags(rest) if f not in options]


# --- links ---------------------------------------------------------------------------------------

def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.lru_cache(maxsize=None)
def anchors(path: Path) -> frozenset[str]:
    """The anchors of a Markdown file's headings."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return frozenset(_slug(h) for h in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M))


def check_links(path: Path) -> list[str]:
    """Relative links of ``path`` whose target file, folder or heading does not exist."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    problems = []
    for target in re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file, _, fragment = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            problems.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            problems.append(f"{target}: no heading #{fragment} in {dest.relative_to(ROOT)}")
    return problems


# --- the tests -----------------------------------------------------------------------------------

def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_documented_commands_match_the_parsers(doc: Path) -> None:
    problems = [f"{_name(doc)}:{line}: {p}" for line, tokens in doc_commands(doc)
                for p in (check_command(tokens) or [])]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_relative_links_resolve(doc: Path) -> None:
    problems = [f"{_name(doc)}: {p}" for p in check_links(doc)]
    assert not problems, "\n".join(problems)


def test_the_documents_show_commands() -> None:
    """The check is not vacuous: the README and the training guide show commands it understands."""
    for doc in (ROOT / "README.md", ROOT / "training" / "README.md"):
        checked = [t for _, t in doc_commands(doc) if check_command(t) is not None]
        assert checked, f"{_name(doc)} shows no command the doc check understands"


@pytest.mark.parametrize("command, expected", [
    ("selfspec generate --model smollm2-135m-instruct --no-such-flag", "selfspec generate has no option --no-such-flag"),
    ("selfspec frobnicate --model m", "no subcommand 'frobnicate'"),
    ("selfspec models fetch x --json", "selfspec models fetch has no option --json"),
    ("python -m selfspec_eval.verify_cost --model m --no-such-flag", "has no option --no-such-flag"),
    ("python -m selfspec_eval.no_such_module", "no module selfspec_eval.no_such_module"),
    ("accelerate launch --num_processes 2 training/train_heads.py --family eagle --no-such-flag 3",
     "training/train_heads.py has no option --no-such-flag"),
    ("python training/generate_data.py --out x --no-such-flag", "has no option --no-such-flag"),
    ("torchrun --nproc-per-node 2 training/no_such_script.py --x 1", "no script training/no_such_script.py"),
    ("make no-such-target", "no make target no-such-target"),
])
def test_the_check_reports_what_does_not_exist(command: str, expected: str) -> None:
    """Negative controls: made-up flags, subcommands, modules, scripts and make targets are reported."""
    problems = check_command(shlex.split(command))
    assert problems and any(expected in p for p in problems), problems


def test_the_check_accepts_real_commands(tmp_path: Path) -> None:
    """Positive controls, and a document with a made-up flag and a broken link fails the checks."""
    assert check_command(shlex.split("selfspec generate --model m --prompt p --json --max-new-tokens=8")) == []
    assert check_command(shlex.split("accelerate launch --multi_gpu training/train_heads.py --family eagle")) == []
    assert check_command(shlex.split("make demo")) == []
    assert check_command(shlex.split("vllm serve model")) is None
    doc = tmp_path / "doc.md"
    doc.write_text("[gone](no/such/file.md)\n\n```bash\nselfspec generate --prompt hi --no-such-flag  # x\n```\n")
    assert [p for _, t in doc_commands(doc) for p in check_command(t)] == [
        "selfspec generate has no option --no-such-flag"]
    assert check_links(doc) == ["no/such/file.md: no such file"]


def test_the_readme_stays_short() -> None:
    """The front door: a newcomer reads it in one sitting; figures and long explanations live in the guides."""
    words = len((ROOT / "README.md").read_text().split())
    assert words <= 1800, f"README.md has {words} words; move detail into docs/ or eval/README.md"


def test_contributing_names_every_library_file() -> None:
    """CONTRIBUTING's table is where a newcomer finds a module: every file of the library is named in it (by its
    path, or by its name in its package's row)."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    rows = {line.split("|")[1]: line for line in text.splitlines() if line.startswith("| `selfspec/")}
    missing = []
    for path in sorted((ROOT / "selfspec").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if path.name == "__init__.py" or f"`{rel}`" in text:
            continue
        package = f"`{path.parent.relative_to(ROOT).as_posix()}/`"
        if not any(package in key and f"`{path.name}`" in row for key, row in rows.items()):
            missing.append(rel)
    assert not missing, f"CONTRIBUTING.md's table does not name {', '.join(missing)}"
