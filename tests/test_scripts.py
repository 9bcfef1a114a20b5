"""Scripts as users write them: the README's quickstart runs as a file exactly as shown (it is
``examples/quickstart.py``), and a script that starts vLLM from unguarded top-level code fails at once with the fix.

vLLM starts its engine core with multiprocessing's spawn, which imports the main script again (as ``__mp_main__``):
training at the top level, outside ``if __name__ == "__main__":``, would run again in there, and vLLM would only say
"Engine core initialization failed". ``VLLMEngine.launch`` checks the main script first (``unguarded_main_line``,
unit-tested here on small files run in-process with ``runpy``, as ``python FILE`` and ``python -m MODULE`` would).
"""

from __future__ import annotations

import asyncio
import os
import re
import runpy
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

from molt_lightning.engines.vllm.main_guard import main_guarded, unguarded_main_line
from molt_lightning.engines.vllm.engine import VLLMEngine

ROOT = Path(__file__).resolve().parents[1]
GUARD = 'if __name__ == "__main__":'


def readme_snippet() -> str:
    """The README's first ```python block, as a user would paste it."""
    m = re.search(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)
    assert m, "README.md has no ```python block"
    return m.group(1)


def run_script(path: Path, cwd: Path, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, str(path)], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=timeout)
    return out, time.perf_counter() - t0


def test_readme_snippet_is_examples_quickstart():
    assert readme_snippet() == (ROOT / "examples" / "quickstart.py").read_text(), \
        "the README's first ```python block and examples/quickstart.py must be the same code: copy one to the other"


@pytest.mark.slow
def test_readme_quickstart_runs_as_a_script(policy_path, tmp_path):
    """Starts a real vLLM engine and trains; the policy is the cached built-in one. The snippet as written, but for its
    30 steps: 3 show that it runs (the 27 more took a minute)."""
    assert readme_snippet() == (ROOT / "examples" / "quickstart.py").read_text()
    script = tmp_path / "quickstart.py"
    script.write_text(readme_snippet().replace("max_steps=30,", "max_steps=3,"))
    assert "max_steps=3," in script.read_text()
    out, seconds = run_script(script, tmp_path, timeout=600)
    assert out.returncode == 0, f"exit {out.returncode} after {seconds:.0f} s:\n{out.stderr[-6000:]}"
    assert "`max_steps=3` reached" in out.stdout + out.stderr
    import pandas as pd

    metrics = pd.read_csv(tmp_path / "runs" / "lightning_logs" / "version_0" / "metrics.csv")
    assert sorted(metrics["step"].dropna().astype(int).unique()) == list(range(3))
    assert metrics["reward"].dropna().between(0, 1).all()


def test_quickstart_on_a_terminal_shows_a_step_bar_and_a_summary(policy_path, tmp_path):
    """A script's own ``L.Trainer`` gets ``molt fit``'s terminal (``AsyncRLModule.configure_callbacks``): with
    ``MOLT_QUIET=1`` (as on a terminal) Lightning's "Epoch 0/-2" bar becomes the step bar, a summary closes the run,
    and what Lightning and the engine say during fit goes to molt.log in the run folder. The quickstart on the torch
    engine, 3 steps; before, its terminal held Lightning's tips, warnings and the epoch bar, and no summary."""
    code = readme_snippet().replace("max_steps=30,", "max_steps=3,").replace("VLLMEngine", "TorchEngine")
    script = tmp_path / "quickstart.py"
    script.write_text(code)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MOLT_QUIET": "1"}
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = tmp_path / "runs" / "lightning_logs" / "version_0"
    shown, log = out.stdout + out.stderr, (run_dir / "molt.log").read_text()
    assert "Step" in shown and "Epoch" not in shown and "molt: 3 steps in" in shown and "mean reward" in shown
    assert "run folder: runs/lightning_logs/version_0 (metrics.csv, reward.png, trace.jsonl.gz, molt.log, " \
        "checkpoints)\n  see every step and sample: molt view runs/lightning_logs/version_0" in shown
    assert "dataloader_iter" in log and "`max_steps=3` reached" in log  # Lightning's warnings and info, during fit
    assert "dataloader_iter" not in shown and "max_steps=3" not in shown
    assert len(shown.splitlines()) <= 12, shown


@pytest.mark.slow
def test_unguarded_quickstart_fails_fast_with_the_fix(policy_path, tmp_path):
    """The quickstart without its guard stops before vLLM starts, naming the file, the line and the guard."""
    code = readme_snippet()
    lines = code.splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.startswith(GUARD))
    unguarded = "".join(lines[:at]) + textwrap.dedent("".join(lines[at + 1:]))
    assert "__main__" not in unguarded and "trainer.fit(" in unguarded
    script = tmp_path / "unguarded.py"
    script.write_text(unguarded)
    out, _ = run_script(script, tmp_path, timeout=300)
    assert out.returncode != 0  # before vLLM starts: no engine core line below (a time bound failed under load)
    line = 1 + unguarded.splitlines().index(next(x for x in unguarded.splitlines() if x.startswith("trainer.fit(")))
    assert f"{script}, line {line} starts a vLLM engine from the script's top-level code" in out.stderr
    assert GUARD in out.stderr and "re-imports this script" in out.stderr
    assert "EngineCore" not in out.stderr and "Engine core initialization failed. See" not in out.stderr


# ----- the detection, on small files -----

PROBE = """from molt_lightning.engines.vllm.main_guard import unguarded_main_line


def probe():
    return unguarded_main_line()

"""


def run_as_main(tmp_path: Path, body: str, run_name: str = "__main__"):
    """Run a small file as ``python FILE`` would (``__main__`` is a module with that ``__file__``); its RESULT."""
    path = tmp_path / "script.py"
    path.write_text(PROBE + textwrap.dedent(body))
    return path, runpy.run_path(str(path), run_name=run_name).get("RESULT", "not set")


def line_of(path: Path, text: str) -> int:
    return 1 + next(i for i, line in enumerate(path.read_text().splitlines()) if text in line)


def test_unguarded_top_level_is_found(tmp_path):
    path, result = run_as_main(tmp_path, "RESULT = probe()\n")
    assert result == (str(path), line_of(path, "RESULT = probe()"), "RESULT = probe()")


def test_unguarded_call_of_a_main_function_names_the_top_level_line(tmp_path):
    path, result = run_as_main(tmp_path, """
        def main():
            global RESULT
            RESULT = probe()


        main()
    """)
    assert result == (str(path), len(path.read_text().splitlines()), "main()")  # the last line


@pytest.mark.parametrize("body", [
    """
    if __name__ == "__main__":
        RESULT = probe()
    """,
    """
    if '__main__' == __name__:
        RESULT = probe()
    """,
    """
    def main():
        global RESULT
        RESULT = probe()


    if __name__ == "__main__":  # guarded through a function called from the guard
        main()
    """,
    """
    if True:
        if len("x") == 1:
            if __name__ == "__main__":
                RESULT = probe()
    """,
    """
    if __name__ == "__main__" and True:
        RESULT = probe()
    """,
    """
    if __name__ != "__main__":
        pass
    else:
        RESULT = probe()
    """,
    """
    if __name__ == "__main__": RESULT = probe()
    """,
], ids=["guarded", "reversed", "via-function", "nested", "and", "else-of-not", "one-line"])
def test_guarded_runs_pass(tmp_path, body):
    _, result = run_as_main(tmp_path, body)
    assert result is None


def test_spawned_child_never_fires(tmp_path):
    """In vLLM's engine process the script is imported as ``__mp_main__``: its top-level code is not ``__main__``'s."""
    _, result = run_as_main(tmp_path, "RESULT = probe()\n", run_name="__mp_main__")
    assert result is None


def test_engine_started_from_a_thread_while_the_main_thread_runs_unguarded_code(tmp_path):
    path, result = run_as_main(tmp_path, """
        import threading

        def work():
            global RESULT
            RESULT = probe()

        t = threading.Thread(target=work)
        t.start(); t.join()
    """)
    assert result[:2] == (str(path), line_of(path, "t.start(); t.join()"))


def test_python_dash_c_and_modules(tmp_path, monkeypatch):
    """``python -c`` (no file) and ``python -m pkg`` (spawn never re-runs a ``__main__`` module) pass unguarded;
    ``python -m module`` is re-run by spawn like a file, so it needs the guard."""
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
    assert unguarded_main_line() is None
    monkeypatch.undo()

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "__main__.py").write_text(PROBE + "RESULT = probe()\n")
    (tmp_path / "mod.py").write_text(PROBE + "RESULT = probe()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert runpy.run_module("pkg", run_name="__main__", alter_sys=True)["RESULT"] is None
    result = runpy.run_module("mod", run_name="__main__", alter_sys=True)["RESULT"]
    assert result == (str(tmp_path / "mod.py"), line_of(tmp_path / "mod.py", "RESULT = probe()"), "RESULT = probe()")


def test_this_pytest_process_and_console_scripts_are_guarded():
    """Under ``pytest`` or ``python -m pytest`` (whichever runs this) the check passes; the ``molt`` and ``pytest``
    console scripts call their entry point under the guard."""
    assert unguarded_main_line() is None
    for name in ("molt", "pytest"):
        script = Path(sys.executable).parent / name
        if not script.exists():
            continue
        source = script.read_text()
        call = 1 + next(i for i, line in enumerate(source.splitlines()) if "main()" in line)
        assert main_guarded(source, call), f"{script}: {source}"


@pytest.mark.parametrize("source,line,guarded", [
    ("run()\n", 1, False),
    (f"{GUARD}\n    pass\nrun()\n", 3, False),  # after the guard block
    (f"def f():\n    run()\n\n\n{GUARD}\n    f()\n", 6, True),
    (f"{GUARD}\n    x = f(\n        1,\n    )\n", 4, True),  # inside a statement spanning lines
    ("if __name__ == '__main__' or x:\n    run()\n", 2, False),  # `or`: the child may run it too
    ("if x:\n    pass\nelif __name__ == '__main__':\n    run()\n", 4, True),
], ids=["top", "after", "function", "multiline", "or", "elif"])
def test_main_guarded_on_sources(source, line, guarded):
    assert main_guarded(source, line) is guarded


def test_engine_core_failure_lists_the_causes(policy_path, monkeypatch):
    """vLLM's bare "Engine core initialization failed" comes back with its common causes, chained to the original."""
    pytest.importorskip("vllm")
    from vllm.v1.engine.async_llm import AsyncLLM

    monkeypatch.setenv("VLLM_LOGGING_LEVEL", os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"))
    original = RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}")

    def fail(*args, **kwargs):
        raise original

    monkeypatch.setattr(AsyncLLM, "from_vllm_config", fail)
    with pytest.raises(RuntimeError) as info:
        asyncio.run(VLLMEngine().open(policy_path))
    assert info.value.__cause__ is original
    message = str(info.value)
    assert GUARD in message and "VLLM_CPU_KVCACHE_SPACE=1 GiB" in message and "kv_cache_gib" in message

    other = RuntimeError("something else")
    monkeypatch.setattr(AsyncLLM, "from_vllm_config", lambda *a, **k: (_ for _ in ()).throw(other))
    with pytest.raises(RuntimeError) as info:
        asyncio.run(VLLMEngine().open(policy_path))
    assert info.value is other


@pytest.mark.slow
def test_the_gpu_check_refuses_a_machine_without_cuda_by_name():
    """``scripts/gpu_check.sh`` (run by hand on a CUDA machine) stops at once here, saying why; its Python part is
    ``benchmarks/gpu_step.py``, whose torch and vLLM rows ran on this CPU (``--device cpu``) when it was written."""
    out = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode != 0 and "gpu_check: no CUDA device visible to torch" in out.stderr
