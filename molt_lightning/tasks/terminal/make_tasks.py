"""Writes the example Harbor tasks beside this file: small shell tasks in six families, each family in a few templated
variants, so that the held-out tasks are new instances of families seen in training.

    python molt_lightning/tasks/terminal/make_tasks.py      # rewrites every task folder here

Families: write-file (``printf``), find-line (``grep``), count-lines (``wc -l``), fix-script (a typo'd command name,
``sed -i``), rename-file (``mv``), sort-file (``sort``); their wording and commands are
``tasks.terminal_agent.FAMILIES``, which the agent's warm-start data draws from too. Each task: ``instruction.md`` (one
sentence), ``task.toml`` (agent 60 s, verifier 30 s, no network; ``[metadata] family`` and ``split``),
``environment/Dockerfile`` (the local Debian base, ``WORKDIR /app``, a ``COPY`` per input file), ``tests/test.sh`` (bash
and coreutils only; writes 1 or 0 to ``/logs/verifier/reward.txt``) and ``solution/solve.sh`` (the one command that
solves it, run in ``/app``).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from molt_lightning.tasks.terminal_agent import fill

HERE = Path(__file__).resolve().parent
BASE = "localhost/debian:bookworm-minbase"
LINES = {  # find-line data: (word, the lines of data.txt; the one holding the word is the answer)
    1: ("apple", ["bananas are yellow", "an apple a day", "grapes grow in bunches", "cherries are red"]),
    2: ("river", ["the mountain is tall", "a river runs to the sea", "the forest is quiet", "clouds move slowly"]),
    3: ("piano", ["she plays the violin", "drums are loud", "he tunes the piano daily", "a flute is light"]),
}


def variants() -> list[dict]:
    """Every task: family, number, split, instruction, input files, check (a bash condition), solution, expected."""
    out = []

    def task(family, n, split, instruction, solve, check, files=None, expected=None, description=""):
        out.append(dict(family=family, n=n, split=split, instruction=instruction, check=check, solve=solve,
                        files=files or {}, expected=expected, description=description))

    for n, name, text, split in ((1, "greeting.txt", "hello", "train"), (2, "name.txt", "alice", "train"),
                                 (3, "color.txt", "blue", "heldout")):
        task("write-file", n, split, *fill("write-file", file=name, text=text),
             check=f'[ "$(cat /app/{name})" = "{text}" ]', description="Create a file with given content.")
    for n, (word, lines) in LINES.items():
        answer = next(line for line in lines if word in line.split())
        task("find-line", n, "heldout" if n == 3 else "train", *fill("find-line", text=word),
             check=f'[ "$(cat /app/answer.txt)" = "{answer}" ]', files={"data.txt": lines},
             description="Copy the line holding a word into a file.")
    for n, name, count, split in ((1, "data.txt", 3, "train"), (2, "list.txt", 5, "train"),
                                  (3, "log.txt", 7, "heldout")):
        task("count-lines", n, split, *fill("count-lines", file=name),
             check=f"[ \"$(tr -d ' \\n' < /app/count.txt)\" = \"{count}\" ]",
             files={name: [f"line {i}" for i in range(1, count + 1)]}, description="Count the lines of a file.")
    task("fix-script", 1, "train", *fill("fix-script", typo="ehco", command="echo", what="writes hello to out.txt"),
         check='timeout 10 bash run.sh && [ "$(cat /app/out.txt)" = "hello" ]',
         files={"run.sh": ["ehco hello > out.txt"]}, description="Fix a typo'd command name in a script.")
    task("fix-script", 2, "train",
         *fill("fix-script", typo="sotr", command="sort", what="writes the sorted lines of names.txt to out.txt"),
         check='timeout 10 bash run.sh && [ "$(cat /app/out.txt)" = "$(cat /tests/expected.txt)" ]',
         files={"run.sh": ["sotr names.txt > out.txt"], "names.txt": ["mia", "ben", "zoe", "ada"]},
         expected=["ada", "ben", "mia", "zoe"], description="Fix a typo'd command name in a script.")
    for n, old, new, text, split in ((1, "draft.txt", "final.txt", "version one", "train"),
                                     (2, "notes.md", "notes.txt", "buy milk", "heldout")):
        task("rename-file", n, split, *fill("rename-file", old=old, new=new),
             check=f'[ ! -e /app/{old} ] && [ "$(cat /app/{new})" = "{text}" ]', files={old: [text]},
             description="Rename a file.")
    for n, name, lines in ((1, "names.txt", ["carol", "alice", "dave", "bob"]),
                           (2, "fruits.txt", ["pear", "fig", "plum", "apple", "kiwi"])):
        task("sort-file", n, "train", *fill("sort-file", file=name),
             check='[ "$(cat /app/sorted.txt)" = "$(cat /tests/expected.txt)" ]', files={name: lines},
             expected=sorted(lines), description="Sort the lines of a file.")
    return out


def files_of(t: dict) -> dict[str, str]:
    """The task folder's files (relative path -> text)."""
    toml = (f'schema_version = "1.4"\n\n[task]\nname = "molt/{t["family"]}-{t["n"]}"\n'
            f'description = "{t["description"]}"\n\n[metadata]\nfamily = "{t["family"]}"\nsplit = "{t["split"]}"\n\n'
            "[verifier]\ntimeout_sec = 30.0\n\n[agent]\ntimeout_sec = 60.0\n\n"
            '[environment]\nbuild_timeout_sec = 120.0\ncpus = 1\nmemory_mb = 256\nnetwork_mode = "no-network"\n')
    docker = f"FROM {BASE}\nWORKDIR /app\n" + "".join(f"COPY {name} /app/{name}\n" for name in t["files"])
    test = ("#!/bin/bash\n# The verifier: reward 1 when the check passes, else 0.\nmkdir -p /logs/verifier\nreward=0\n"
            f"cd /app && {t['check']} && reward=1\necho $reward > /logs/verifier/reward.txt\n")
    out = {"instruction.md": t["instruction"] + "\n", "task.toml": toml, "environment/Dockerfile": docker,
           "tests/test.sh": test, "solution/solve.sh": f"#!/bin/bash\n{t['solve']}\n"}
    out.update({f"environment/{name}": "\n".join(body) + "\n" for name, body in t["files"].items()})
    if t["expected"] is not None:
        out["tests/expected.txt"] = "\n".join(t["expected"]) + "\n"
    return out


def write(root: Path = HERE) -> list[Path]:
    """Write every task folder under ``root`` (each rewritten from scratch); returns the folders."""
    folders = []
    for t in variants():
        folder = root / f"{t['family']}-{t['n']}"
        shutil.rmtree(folder, ignore_errors=True)
        for rel, text in files_of(t).items():
            path = folder / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            if rel in ("tests/test.sh", "solution/solve.sh"):
                path.chmod(0o755)
        folders.append(folder)
    return folders


if __name__ == "__main__":
    written = write(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
    print(f"wrote {len(written)} tasks under {written[0].parent}")
