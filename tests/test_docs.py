"""The manual names only what exists: every path, module, dotted name and command that README.md and docs/*.md name.

- **links**: every relative markdown link (``[text](target)``, images too) points at a file or folder of the
  repository, and its ``#anchor``, if any, at a heading of that page (GitHub's slugs);
- **paths**: every repository path named in code (inline ``code`` and fenced blocks): a path whose first folder is a
  top-level entry of the repository (``recipes/default.yaml``, ``benchmarks/weight_sync.py``, ``docs/engines.md``)
  exists there; one whose first folder is a folder of the package (``engines/base.py``) exists under
  ``molt_lightning/``; a bare ``name.py`` (or ``.sh``) in inline code is a file somewhere in the repository; in
  ``tests/x.py::test_y`` the test exists too. A glob must match a file; ``{a,b}`` is expanded;
- **dotted names**: every ``molt_lightning.x.y`` (or ``molt_lightning.x:y``) imports: the longest prefix that is a
  module is imported, the rest is looked up as attributes;
- **commands**: every ``python -m molt_lightning...`` is a module that runs as a script, every ``molt SUBCOMMAND``
  and ``molt-bench SUBCOMMAND`` exists, and every ``molt-bench reproduce NAME`` and ``molt-bench run PROTOCOL`` names
  an entry of ``benchmarks/reported.yaml`` and a protocol of ``protocols/``.

Not checked, on purpose: URLs; absolute paths and ``~`` (``/tmp``, ``/dev/shm``, ``~/.cache``); what runs and
set-up write (``EXEMPT_ROOTS``: ``runs/``, ``reproductions/``, ``lightning_logs/``, ``.venv/``); the workflow's example
dataset (``EXAMPLE_FILES``); shell variables (``recipes/algorithms/$r.yaml``); and placeholders (``PLACEHOLDER``: a
path that does not exist and has a part in capitals or ``...``, as ``runs/NAME/...`` or ``recipes/X.yaml``).

A failure lists every name that does not exist as ``file:line: name: why``, one test per page and kind.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import itertools
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "molt_lightning"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

EXEMPT_ROOTS = {"runs", "reproductions", "lightning_logs", ".venv", "bench-reports"}  # what runs and set-up write
EXAMPLE_FILES = {"data/train.jsonl", "data/test.jsonl"}  # the workflow's example dataset, the user's own files
PLACEHOLDER = re.compile(r"(?:^|/)(?:[A-Z][A-Z0-9_]*|\.\.\.)(?:[./]|$)")  # a missing NAME/, X.yaml, FOLDER, .../
SOURCE_SUFFIXES = (".py", ".sh")  # the bare file names that are checked


@dataclass
class Doc:
    """A page's text, and the same text with the fenced blocks blanked (line numbers kept) for inline code."""

    path: Path
    text: str
    prose: str
    blocks: list[tuple[int, str]]  # (line of the block's first line, the block's text)

    @property
    def name(self) -> str:
        return str(self.path.relative_to(ROOT))

    def line(self, text: str, pos: int) -> int:
        return text.count("\n", 0, pos) + 1

    def inline_code(self):
        """(line, text) of every inline code span outside the fenced blocks."""
        for m in re.finditer(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", self.prose, re.S):
            if "\n\n" not in m[2]:
                yield self.line(self.prose, m.start(2)), m[2]

    def code(self):
        """(line, text) of every piece of code: inline spans, then each line of each fenced block."""
        yield from self.inline_code()
        for first, block in self.blocks:
            for i, text in enumerate(block.splitlines()):
                yield first + i, text


def read(path: Path) -> Doc:
    text = path.read_text()
    lines, prose, blocks, fence, start = text.splitlines(), [], [], None, 0
    for i, line in enumerate(lines):
        opens = re.match(r"\s*(```+|~~~+)", line)
        if fence is None and opens:
            fence, start, body = opens[1], i, []
            prose.append("")
        elif fence is not None and line.strip().startswith(fence) and line.strip().strip(fence[0]) == "":
            blocks.append((start + 2, "\n".join(body)))
            fence = None
            prose.append("")
        elif fence is not None:
            body.append(line)
            prose.append("")
        else:
            prose.append(line)
    return Doc(path, text, "\n".join(prose), blocks)


def doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def report(doc: Doc, problems: list[tuple[int, str, str]]) -> None:
    assert not problems, f"{len(problems)} names in {doc.name} do not exist:\n" + "\n".join(
        f"  {doc.name}:{line}: {name}: {why}" for line, name, why in problems)


# ----- links -----

def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@cache
def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in read(path).prose.splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m[1])
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


@pytest.mark.parametrize("path", DOCS, ids=doc_id)
def test_links_point_at_files_and_headings(path):
    doc, problems = read(path), []
    for m in re.finditer(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", doc.prose):
        target = m[1]
        if re.match(r"[a-z][a-z+.-]*:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        where = (doc.path.parent / file).resolve() if file else doc.path
        line = doc.line(doc.prose, m.start())
        if not where.exists():
            problems.append((line, target, "no such file"))
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            problems.append((line, target, f"no heading with this anchor in {where.relative_to(ROOT)}"))
    report(doc, problems)


# ----- paths -----

def expand(token: str) -> list[str]:
    """``recipes/algorithms/{a,b}.yaml`` as its two paths."""
    m = re.search(r"\{([\w.-]+(?:,[\w.-]+)+)\}", token)
    if not m:
        return [token]
    return list(itertools.chain.from_iterable(
        expand(token[:m.start()] + choice + token[m.end():]) for choice in m[1].split(",")))


def tokens(code: str):
    for raw in re.split(r"[\s,;=\"'()\[\]<>|`]+", re.sub(r"\{[\w.-]+(?:,[\w.-]+)+\}",
                                                             lambda m: m[0].replace(",", "\0"), code)):
        token = raw.replace("\0", ",").strip(".:").lstrip("{").rstrip("}")
        if token:
            yield from expand(token)


def exists(base: Path, path: str) -> bool:
    return any(base.glob(path)) if "*" in path else (base / path).exists()


@cache
def files_named(name: str) -> bool:
    return any(p for p in ROOT.rglob(name) if not set(p.relative_to(ROOT).parts) & (EXEMPT_ROOTS | {".git"}))


def path_problem(token: str, inline: bool) -> str | None:
    """Why ``token`` names a repository path that does not exist; None when it exists or is not one."""
    if "://" in token or token.startswith(("/", "~", "-")) or "$" in token:  # a URL, outside the repository, a flag
        return None
    token, _, test = token.partition("::")  # tests/test_data.py::test_name
    first, last = token.split("/")[0], token.split("/")[-1]
    if token in EXAMPLE_FILES or first in EXEMPT_ROOTS:
        return None
    if "/" not in token:  # a bare file name: only source files are checked (metrics.csv, eval.jsonl are outputs)
        missing = inline and token.endswith(SOURCE_SUFFIXES) and re.fullmatch(r"[\w.-]+", token) and \
            not files_named(token)
        why = "no file of this name in the repository" if missing else None
    elif (ROOT / first).exists():
        why = None if exists(ROOT, token) else "no such path in the repository"
        if why is None and test and not re.search(rf"^\s*(?:async )?def {re.escape(test)}\(",
                                                  (ROOT / token).read_text(), re.M):
            why = f"{token} has no test {test}"
    elif (PACKAGE / first).is_dir() and (last == "" or "." in last):
        # a path inside the package (engines/base.py, agents/adapters/); not a metric name (rollout/buffered_groups)
        why = None if exists(PACKAGE, token) else "no such path under molt_lightning/"
    else:
        why = None
    return None if why is None or PLACEHOLDER.search(token) else why


@pytest.mark.parametrize("path", DOCS, ids=doc_id)
def test_paths_exist(path):
    doc, problems = read(path), []
    inline = {(line, text) for line, text in doc.inline_code()}
    for line, code in doc.code():
        for token in tokens(code):
            why = path_problem(token, (line, code) in inline)
            if why:
                problems.append((line, token, why))
    report(doc, problems)


# ----- dotted names -----

NEEDS = "needs the optional package "  # resolve()'s answer for a name whose import lacks a third-party package
DOTTED = re.compile(r"\bmolt_lightning(?:\.[A-Za-z_]\w*)+(?::[A-Za-z_]\w*)?")


@cache
def resolve(name: str) -> str | None:
    """Why ``name`` does not resolve (None when it does): import its longest module prefix, getattr the rest."""
    parts = name.replace(":", ".").split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name == module or (e.name and module.startswith(e.name + ".")):
                continue  # not a module: try a shorter prefix
            if e.name and not e.name.startswith("molt_lightning"):  # an optional package this install lacks
                return f"{NEEDS}{e.name.partition('.')[0]}"
            return f"importing {module} fails: {e}"
        except Exception as e:  # noqa: BLE001 - any failure of the import is the answer
            return f"importing {module} fails: {type(e).__name__}: {e}"
        for j, attr in enumerate(parts[i:], start=i):
            if not hasattr(obj, attr):
                return f"{'.'.join(parts[:j])} has no attribute {attr!r}" + moved_hint(name)
            obj = getattr(obj, attr)
        return None
    return "does not import"


def moved_hint(name: str) -> str:
    moved = importlib.import_module("molt_lightning").MOVED
    old = next((m for m in sorted(moved, key=len, reverse=True) if name == m or name.startswith(m + ".")), None)
    return f" (it moved: {old} -> {moved[old]})" if old else ""


@pytest.mark.parametrize("path", DOCS, ids=doc_id)
def test_dotted_names_import(path):
    doc, problems = read(path), []
    for m in DOTTED.finditer(doc.text):
        why = resolve(m[0])
        if why:
            problems.append((doc.line(doc.text, m.start()), m[0], why))
    report(doc, [p for p in problems if not p[2].startswith(NEEDS)])
    if needs := sorted({p[2].removeprefix(NEEDS) for p in problems}):  # only these: the test tier has them
        pytest.skip(f"{doc.name} names modules that need {', '.join(needs)}, not installed here: `make setup-test` "
                    "(or the extra that names them, make extra-NAME) checks them too")


# ----- commands -----

@cache
def molt_subcommands() -> set[str]:
    """The commands ``molt --help`` lists (``cli.COMMANDS``: ``main`` refuses any other word)."""
    from molt_lightning.commands.cli import COMMANDS

    return set(COMMANDS)


@cache
def bench_subcommands() -> set[str]:
    tree = ast.parse((PACKAGE / "bench" / "cli.py").read_text())
    table = next(n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "COMMANDS")
    return {k.value for k in table.keys}


@cache
def reported() -> set[str]:
    return set(yaml.safe_load((ROOT / "benchmarks" / "reported.yaml").read_text()))


def runs_as_script(module: str) -> str | None:
    spec = importlib.util.find_spec(module)
    if spec is None:
        return "no such module"
    if spec.submodule_search_locations:  # a package: python -m runs its __main__
        return None if importlib.util.find_spec(f"{module}.__main__") else "a package without __main__.py"
    source = Path(spec.origin).read_text()
    return None if re.search(r"__name__\s*==\s*['\"]__main__['\"]", source) else "no `if __name__ == \"__main__\":`"


COMMAND = re.compile(r"(?:^|(?<=[\s(`]))(?:\S*/)?(molt|molt-bench)[ \t]+([a-z][\w-]*)(?:[ \t]+([a-z][\w-]*))?", re.M)


def command_problems(code: str):
    for m in re.finditer(r"-m\s+(molt_lightning[\w.]*)", code):
        why = runs_as_script(m[1])
        if why:
            yield f"python -m {m[1]}", why
    for m in COMMAND.finditer(code):
        tool, sub, arg = m[1], m[2], m[3]
        known = molt_subcommands() if tool == "molt" else bench_subcommands()
        if sub not in known:
            yield f"{tool} {sub}", f"no such subcommand (there are: {', '.join(sorted(known))})"
        elif tool == "molt-bench" and sub == "reproduce" and arg and arg not in reported():
            yield f"{tool} {sub} {arg}", "no such entry in benchmarks/reported.yaml"
        elif tool == "molt-bench" and sub == "run" and arg and not (ROOT / "protocols" / f"{arg}.yaml").exists():
            yield f"{tool} {sub} {arg}", "no such protocol in protocols/"


@pytest.mark.parametrize("path", DOCS, ids=doc_id)
def test_commands_exist(path):
    doc, problems = read(path), []
    for line, code in doc.code():
        problems += [(line, name, why) for name, why in command_problems(code)]
    report(doc, problems)


# ----- the checks themselves -----

def test_the_checks_catch_what_they_should(tmp_path):
    assert slug("Measured (`benchmarks/`, this machine: 2 cores, 24 GiB)") == \
        "measured-benchmarks-this-machine-2-cores-24-gib"
    assert slug("A pretrained policy that learns here: `recipes/smollm2_addition.yaml`") == \
        "a-pretrained-policy-that-learns-here-recipessmollm2_additionyaml"
    assert list(tokens("recipes/algorithms/{grpo,dapo}.yaml, x")) == \
        ["recipes/algorithms/grpo.yaml", "recipes/algorithms/dapo.yaml", "x"]
    assert path_problem("recipes/default.yaml", False) is None
    assert path_problem("recipes/nope.yaml", False)
    assert path_problem("engines/vllm/cpu.py", False) is None and path_problem("engines/vllm_load.py", False)
    assert path_problem("recipes/algorithms/*.yaml", False) is None and path_problem("recipes/*.nope", False)
    assert path_problem("rollout.py", True) and path_problem("weights.py", True) is None
    assert path_problem("rollout/buffered_groups", True) is None and path_problem("agents/adapters/", True) is None
    assert path_problem("tests/test_docs.py::test_paths_exist", True) is None
    assert path_problem("tests/test_docs.py::test_nope", True)
    assert path_problem("containers/README.md", True) is None and path_problem("containers/readme.md", True)
    assert path_problem("containers/NAME.md", True) is None  # a missing all-caps name: a placeholder
    for exempt in ("runs/NAME/version_0/checkpoints/last.ckpt", "runs/default/metrics.csv", "/tmp/x", "~/.cache/x",
                   "https://github.com/a/b", "data/train.jsonl", "recipes/X.yaml", "out/", "recipes/$r.yaml"):
        assert path_problem(exempt, True) is None, exempt
    assert resolve("molt_lightning.agents.Answer") is None
    assert resolve("molt_lightning.tasks.verifiers_envs:PythonToolTaskset") == (  # verifiers: the envs extra
        None if importlib.util.find_spec("verifiers") else f"{NEEDS}verifiers")
    assert "moved" in resolve("molt_lightning.envs.EnvAgent")
    assert "no attribute" in resolve("molt_lightning.agents.NoSuchThing")
    assert [n for n, _ in command_problems("molt fit --config x && molt nope && python -m molt_lightning.nope")] == \
        ["python -m molt_lightning.nope", "molt nope"]
    assert [n for n, _ in command_problems("molt-bench reproduce default-run; molt-bench reproduce nope")] == \
        ["molt-bench reproduce nope"]
    page = tmp_path / "page.md"
    page.write_text("# T\n\n`a`\n\n```bash\nmolt fit\n```\n\n`b\nc`\n")
    doc = read(page)
    assert list(doc.code()) == [(3, "a"), (9, "b\nc"), (6, "molt fit")]
