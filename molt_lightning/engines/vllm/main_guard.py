"""Scripts that start a vLLM engine must guard their training with ``if __name__ == "__main__":``.

vLLM starts its engine core with multiprocessing *spawn*, which imports the main script again in the new process; a
script that trains at its top level would train again there, and vLLM fails with a bare "Engine core initialization
failed". ``unguarded_main_line`` finds the main script's top-level line that is running now and checks, from the
script's syntax tree, whether it lies under the guard; ``VLLMEngine.launch`` raises with the file, line and fix before
vLLM starts. Written by hand: neither vLLM nor multiprocessing offers this check.
"""

from __future__ import annotations

import ast
import os
import sys
import threading

_UNGUARDED = """{path}, line {line} starts a vLLM engine from the script's top-level code, outside an \
`if __name__ == "__main__":` block:
    {code}
vLLM starts its engine core in a new process (multiprocessing "spawn") that imports {name} again: unguarded, that
import runs this training again inside the engine process, and vLLM fails with "Engine core initialization failed".
Fix: put the code that runs the training under the guard (imports and definitions such as `async def agent` may stay
at the top level), e.g.

    if __name__ == "__main__":  # vLLM's engine process re-imports this script
        trainer = L.Trainer(max_steps=20)
        trainer.fit(module)
"""

def require_main_guard() -> None:
    """Raise before vLLM starts when the main script runs this from unguarded top-level code (see ``_UNGUARDED``)."""
    where = unguarded_main_line()
    if where is not None:
        path, line, code = where
        raise RuntimeError(_UNGUARDED.format(path=path, line=line, code=code, name=os.path.basename(path)))


def unguarded_main_line() -> tuple[str, int, str] | None:
    """``(file, line, source line)`` of the main script's top-level code that is running now (on this thread, else
    on the main thread) outside an ``if __name__ == "__main__":`` block; ``None`` when there is none or spawn would
    not re-run the main module: no file (``python -c``, notebooks), a package's or a directory's ``__main__``
    (``python -m pkg``, ``python -m pytest``: spawn never re-runs those), IPython, or a child process (there
    ``__name__`` is ``"__mp_main__"``). Console scripts (``molt``, ``pytest``) are guarded files: ``None``."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    if not path or spec_name == "__main__" or (spec_name or "").endswith(".__main__"):
        return None
    if spec_name is None and os.path.splitext(os.path.basename(path))[0] == "ipython":
        return None
    frames = [sys._getframe(1)]
    main_thread = threading.main_thread().ident
    if threading.get_ident() != main_thread:
        frames.append(sys._current_frames().get(main_thread))
    for frame in frames:
        while frame is not None:
            if (frame.f_code.co_name == "<module>" and frame.f_globals is main.__dict__
                    and frame.f_globals.get("__name__") == "__main__"):
                break
            frame = frame.f_back
        if frame is None:
            continue
        line = frame.f_lineno
        try:
            with open(path, encoding="utf-8") as f:
                source = f.read()
            guarded = main_guarded(source, line)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            return None  # not a Python source we can read: no verdict
        if guarded:
            return None
        lines = source.splitlines()
        return path, line, lines[line - 1].strip() if 0 < line <= len(lines) else ""
    return None


def main_guarded(source: str, line: int) -> bool:
    """Whether ``line`` of ``source`` lies in a block that runs only when ``__name__ == "__main__"``: the body of
    ``if __name__ == "__main__":`` (either way round, ``and``-ed with more, nested at any depth) or the ``else`` of
    ``if __name__ != "__main__":``."""
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.If):
            continue
        test = _main_test(node.test)
        if test == "==" and node.test.end_lineno <= line <= node.body[-1].end_lineno:
            return True
        if test == "!=" and node.orelse and _first_line(node.orelse[0]) <= line <= node.orelse[-1].end_lineno:
            return True
    return False


def _main_test(test: ast.expr) -> str | None:
    """``"=="`` for a test true only when ``__name__ == "__main__"``, ``"!="`` for its negation, else None."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return "==" if any(_main_test(v) == "==" for v in test.values) else None
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Eq, ast.NotEq))):
        return None
    sides = [test.left, test.comparators[0]]
    is_name = [isinstance(s, ast.Name) and s.id == "__name__" for s in sides]
    is_main = [isinstance(s, ast.Constant) and s.value == "__main__" for s in sides]
    if (is_name[0] and is_main[1]) or (is_main[0] and is_name[1]):
        return "==" if isinstance(test.ops[0], ast.Eq) else "!="
    return None


def _first_line(stmt: ast.stmt) -> int:
    return min([stmt.lineno] + [d.lineno for d in getattr(stmt, "decorator_list", [])])
