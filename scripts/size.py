"""How big molt_lightning is, as markdown tables, in three parts.

1. Code lines by folder: lines holding a token other than a comment (``tokenize``) outside module, class and function
   docstrings (``ast``); a row per directory, a subtotal per top-level folder with subfolders, the core (the package
   less ``bench/``, ``models/``, ``tasks/``: what the project's rules are measured by), the largest files.
2. What a default ``molt fit`` imports, per process (``--steps``; ``--no-run`` skips this minute or two): a
   ``sitecustomize.py`` first on ``PYTHONPATH`` puts a finder first on ``sys.meta_path`` in every Python process of the
   run (vLLM's spawned engine core and workers inherit the environment), and it appends each molt_lightning module
   imported to ``<dir>/<pid>.txt`` at once (vLLM's processes are killed: no atexit). The run writes to a temporary dir.
3. Beside labs-molt, by its rule (the files "the RL path uses", found "by tracing the import graph" from the RL entry
   point; blank and comment-only lines out; SFT out): the static closure of imports (lazy ones too, names a package's
   ``__getattr__`` finds in a dict of module paths, string constants naming a module) from ``molt fit``'s entry point
   in pyproject.toml and the dotted names in the recipe; with and without docstrings. labs-molt's numbers are the
   stored ones below unless ``--peer`` names a checkout.

    .venv/bin/python scripts/size.py [--no-run] [--steps 2] [--peer DIR [--peer-entry molt/cli/train_rl_ray.py]]
"""

from __future__ import annotations

import argparse
import ast
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = "molt_lightning"
NOT_CORE = ("bench", "models", "tasks")
RECIPE = REPO / "recipes" / "default.yaml"
# labs-molt (github.com/NVIDIA-NeMo/labs-molt) measured by closure() and count() below on 2026-12-04 (--exclude sft):
# its newest snapshot, and the commit that put "~9.2K" in its README ("Molt measured 2026-07-20 on this repo")
PEER_ENTRY = "molt/cli/train_rl_ray.py"
STORED_PEER = [  # commit, when, files, code lines with docstrings, without them, all lines
    ("2d626085668af2b838478b7b783dbf278bb91b4b", "2026-08-06, newest", 52, 9374, 7926, 13110),
    ("fdb9a6b9ad5754152536b34852753dc6ac142e92", "2026-07-20, the ~9.2K claim", 52, 9210, 7802, 12839)]
NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
DOC_OWNERS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def is_str(node) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def count(file: Path, docstrings: bool = False) -> int:
    """Code lines of ``file``: lines a token other than a comment is on; docstrings' lines only if ``docstrings``."""
    src = Path(file).read_text(encoding="utf-8")
    lines = {n for tok in tokenize.generate_tokens(io.StringIO(src).readline) if tok.type not in NOT_CODE
             for n in range(tok.start[0], tok.end[0] + 1)}
    for node in () if docstrings else ast.walk(ast.parse(src)):
        doc = node.body[0] if isinstance(node, DOC_OWNERS) and node.body else None
        if isinstance(doc, ast.Expr) and is_str(doc.value) and doc.lineno != getattr(node, "lineno", 0):  # own line
            lines -= set(range(doc.lineno, doc.end_lineno + 1))
    return len(lines)


def n_lines(file: Path) -> int:
    return len(file.read_text(encoding="utf-8").splitlines())


def table(header: list[str], rows: list[list]) -> str:
    cells = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(f"{c:,}" if isinstance(c, int) else str(c) for c in row) + " |" for row in cells)


def module_file(root: Path, name: str) -> Path | None:
    base = Path(root, *name.split("."))
    return next((f for f in (base.with_suffix(".py"), base / "__init__.py") if f.is_file()), None)


def module_name(root: Path, file: Path) -> str:
    parts = file.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def short_names(root: Path, files) -> str:
    """The files' module names, less the package's: ``agents.client``; the package's ``__init__`` as `__init__`."""
    return ", ".join(sorted(module_name(root, f).partition(".")[2] or "`__init__`" for f in files))


# ------------------------------------------------------------------------------------------------ 1. code by folder
def by_folder(root: Path) -> str:
    files = sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    stats = {f: (count(f), n_lines(f)) for f in files}

    def row(label, fs):
        return [label, len(fs), sum(stats[f][0] for f in fs), sum(stats[f][1] for f in fs)]
    top = {f: (f.relative_to(root).parts[:-1] or ("(root)",))[0] for f in files}
    rows = []
    for t in sorted(set(top.values()), key=lambda t: (t != "(root)", t)):
        mine = [f for f in files if top[f] == t]
        dirs = sorted({f.parent for f in mine}, key=lambda d: d.relative_to(root).parts)
        rows += [row(f"{d.relative_to(root).as_posix()}/" if d != root else t, [f for f in mine if f.parent == d])
                 for d in dirs]
        rows += [row(f"**{t}/ in all**", mine)] if len(dirs) > 1 else []
    core = [f for f in files if top[f] not in NOT_CORE]
    big = sorted(files, key=lambda f: -stats[f][0])[:10]
    return "\n".join([
        "## 1. Code lines by folder", "", table(["folder", "files", "code lines", "lines"], rows + [
            row(f"**package** ({root.name}/)", files), row(f"**core** (less {', '.join(NOT_CORE)})", core)]), "",
        f"Core: **{row('', core)[2]:,}** code lines in {len(core)} files. The largest files:", "",
        table(["file", "code lines", "lines"], [[f.relative_to(root.parent).as_posix(), *stats[f]] for f in big])])


# ------------------------------------------------------------------------------------ 2. what a `molt fit` imports
SITECUSTOMIZE = '''\
import importlib.machinery, importlib.util, os, sys
def _write(line):
    with open(os.path.join(os.environ["MOLT_SIZE_IMPORTS"], f"{os.getpid()}.txt"), "a") as f:
        f.write(line + "\\n")
def _header():  # parent pid and command line, less the interpreter (a fork's is its parent's)
    _write(f"# {os.getppid()} " + " ".join(" ".join(sys.orig_argv[1:]).split())[:120])
class _Record:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "molt_lightning":
            _write(name)
_header()
os.register_at_fork(after_in_child=_header)
sys.meta_path.insert(0, _Record())
_here = os.path.dirname(os.path.abspath(__file__))  # then run the sitecustomize this one shadows, if any
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
if _spec is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
'''


def what_runs(steps: int) -> str:
    molt, tmp = REPO / ".venv" / "bin" / "molt", Path(tempfile.mkdtemp(prefix="molt-size-"))
    if not molt.exists():
        sys.exit(f"no {molt}: run `make setup` first, or pass --no-run")
    for sub in ("site", "imports", "cwd"):
        (tmp / sub).mkdir()
    (tmp / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, "MOLT_SIZE_IMPORTS": str(tmp / "imports"), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp / "site"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [str(molt), "fit", "--config", str(RECIPE), "--trainer.max_steps", str(steps)]
    with open(tmp / "run.log", "w") as log:  # the console script is exec'd: its pid is the trainer's
        trainer = subprocess.Popen(cmd, cwd=tmp / "cwd", env=env, stdout=log, stderr=subprocess.STDOUT)
        if trainer.wait():
            sys.exit(f"`{' '.join(cmd)}` failed ({trainer.returncode}): see {tmp / 'run.log'}")
    procs = {}  # pid -> (parent pid, command, molt_lightning files)
    for rec in (tmp / "imports").glob("*.txt"):
        head, *imports = rec.read_text().splitlines()
        ppid, _, command = head[2:].partition(" ")
        files = {f for n in imports if not n.startswith("#") and (f := module_file(REPO, n))}
        procs[int(rec.stem)] = (int(ppid), command, files)
    shutil.rmtree(tmp)  # kept only when the run fails

    def role(pid, depth=0):  # how far under the trainer, by parent pids
        if pid == trainer.pid:
            return f"{'grand' * (depth - 1)}child of the trainer" if depth else "trainer"
        return role(procs[pid][0], depth + 1) if pid in procs else "not under the trainer"
    busy = {pid: p for pid, p in sorted(procs.items()) if p[2]}
    union = set().union(*(p[2] for p in busy.values()))
    rows = [[str(pid), role(pid), f"`{command[:70]}`", len(files), sum(map(count, files))]
            for pid, (_, command, files) in busy.items()]
    lists = [f"- {pid} ({role(pid)}, `{PKG}.` left off): {short_names(REPO, files)}"
             for pid, (*_, files) in busy.items()]
    return "\n".join([
        f"## 2. What `molt fit --config {RECIPE.relative_to(REPO)} --trainer.max_steps {steps}` imports", "",
        table(["pid", "process", "command", "molt_lightning modules", "their code lines"],
              rows + [["", "**all of them**", "", len(union), sum(map(count, union))]]), "",
        f"{len(procs) - len(busy)} more Python processes imported no molt_lightning module. A spawned process imports "
        f"the `molt` script again as `__mp_main__` (hence `commands.cli`).", "", *lists])


# ----------------------------------------------------------------------------------- 3. static closure, labs-molt
def lazy_home(init: Path, attr: str) -> str | None:
    """Where a package's ``__getattr__`` imports ``attr`` from, if a dict literal says (``{"Name": ".module"}``)."""
    for node in ast.walk(ast.parse(init.read_text(encoding="utf-8"))):
        for k, v in zip(node.keys, node.values) if isinstance(node, ast.Dict) else ():
            if is_str(k) and k.value == attr and is_str(v):
                return v.value.lstrip(".")
    return None


def resolve(root: Path, prefix: str, name: str, attr: str | None = None) -> list[Path]:
    """The files ``import name`` (``from name import attr``) runs: each package's ``__init__``, the module, ``attr``."""
    parts = name.split(".")
    if parts[0] != prefix:
        return []
    files = [f for i in range(1, len(parts) + 1) if (f := module_file(root, ".".join(parts[:i])))]
    if attr and files and files[-1].name == "__init__.py":
        if sub := module_file(root, f"{name}.{attr}"):
            files.append(sub)
        elif home := lazy_home(files[-1], attr):  # relative to the package, or else absolute
            files += resolve(root, prefix, f"{name}.{home}" if module_file(root, f"{name}.{home}") else home)
    return files


def resolve_dotted(root: Path, prefix: str, dotted: str) -> list[Path]:
    """``pkg.module.Name`` as a recipe or ``importlib`` takes it: the longest prefix that is a module, then the name."""
    parts = dotted.split(".")
    i = next((i for i in range(len(parts), 0, -1) if module_file(root, ".".join(parts[:i]))), 0)
    return resolve(root, prefix, ".".join(parts[:i]), parts[i] if i < len(parts) else None) if i else []


def imported(root: Path, prefix: str, file: Path) -> list[Path]:
    pkg = module_name(root, file).split(".")[: None if file.name == "__init__.py" else -1]
    found = []
    for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [f for a in node.names for f in resolve(root, prefix, a.name)]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(pkg[: len(pkg) - node.level + 1] + [node.module or ""]).strip(".") if node.level else \
                node.module
            found += [f for a in node.names for f in resolve(root, prefix, base, a.name)]
        elif is_str(node) and re.fullmatch(rf"{prefix}(\.\w+)+", node.value):
            found += resolve_dotted(root, prefix, node.value)
    return found


def closure(repo_root: Path, package_prefix: str, roots: list, exclude: str = "") -> set[Path]:
    """Files reached from ``roots`` (files or dotted names) by imports inside ``package_prefix``; a file whose path
    matches the regex ``exclude`` is left out and not followed."""
    todo = [f for r in roots for f in ([r] if isinstance(r, Path) else resolve_dotted(repo_root, package_prefix, r))]
    seen: set[Path] = set()
    while todo:
        f = todo.pop().resolve()
        if f not in seen and not (exclude and re.search(exclude, f.relative_to(repo_root).as_posix())):
            seen.add(f)
            todo += imported(repo_root, package_prefix, f)
    return seen


def beside_peer(args) -> str:
    script = re.search(r'^molt\s*=\s*"([\w.]+):', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    dotted = sorted(set(re.findall(rf"\b{PKG}(?:\.\w+)+", RECIPE.read_text())))
    groups = [(PKG, REPO, PKG, f"`molt fit` ({script} and the {len(dotted)} names in {RECIPE.relative_to(REPO)})",
               closure(REPO, PKG, [module_file(REPO, script), *dotted], args.exclude))]
    if args.peer:
        peer = Path(args.peer).resolve()
        top = Path(args.peer_entry).parts[0]
        groups.append((peer.name, peer, top, f"{args.peer_entry} (the checkout at --peer)",
                       closure(peer, top, [peer / args.peer_entry], args.exclude)))
    rows = [[f"{name}: {label}", len(fs), sum(count(f, True) for f in fs), sum(map(count, fs)), sum(map(n_lines, fs))]
            for name, _, _, label, fs in groups]
    if not args.peer:
        rows += [[f"labs-molt: {PEER_ENTRY} (stored: commit {commit[:12]} of {when}, measured 2026-12-04)", *nums]
                 for commit, when, *nums in STORED_PEER]
    listed = [f"- {name} (`{top}.` left off): {short_names(root, fs)}" for name, root, top, _, fs in groups]
    return "\n".join([
        "## 3. Beside labs-molt: the files imported from the RL entry point", "",
        f"Static closure; files matching `{args.exclude}` left out. labs-molt's README: \"~9.2K LOC\", \"Counts code "
        "lines only (blank and comment-only lines excluded)\": docstrings in.", "",
        table(["", "files", "code lines, docstrings in", "code lines, docstrings out", "lines"], rows), "", *listed])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    ap.add_argument("--no-run", action="store_true", help="skip part 2 (it runs `molt fit`: a minute or two)")
    ap.add_argument("--steps", type=int, default=2, help="trainer.max_steps of part 2's run")
    ap.add_argument("--peer", help="a checkout of labs-molt to measure (else its stored numbers)")
    ap.add_argument("--peer-entry", default=PEER_ENTRY, help="its RL entry point, relative to --peer")
    ap.add_argument("--exclude", default="sft", help="regex: files left out of both closures (their rule: SFT out)")
    args = ap.parse_args()
    print(f"# Size of {PKG}\n\n{by_folder(REPO / PKG)}\n")
    if not args.no_run:
        print(what_runs(args.steps) + "\n")
    print(beside_peer(args))


if __name__ == "__main__":
    main()
