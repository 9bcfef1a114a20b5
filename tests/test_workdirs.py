"""Harbor tasks put their work folder anywhere (issue 61): tasks written here, each with its WORKDIR in another place
(/app; /srv, /home, /opt and /usr/src, which the host has; /data/inbox, whose /data it has not), a Dockerfile that
copies files into it, tests/test.sh writing /logs/verifier/reward.txt and a solution/solve.sh that lists, makes a folder
and writes in the work folder. In both shell backends the reference solution (run as Harbor's oracle runs it: ``bash
/solution/solve.sh``) scores 1 and an empty episode 0 for every task, and nothing on the host is written.

The buildah half needs what tests/test_shell_sandbox.py's does (root, buildah, the local base image).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from molt_lightning.tasks.harbor import read_task, verify
from test_shell_sandbox import BACKENDS, BASE, make_backend

WORKDIRS = ["/app", "/srv/x", "/home/user/work", "/opt/tool", "/usr/src/app", "/data/inbox"]

SOLVE = """#!/bin/bash
set -e
mkdir archive
for f in $(ls *.log); do
    mv "$f" archive/
done
ls archive > index.txt
mv index.txt archive/
echo done > status.txt
"""

TEST = """#!/bin/bash
# run from the work folder; 1 when the logs were archived and listed, the rest left, else 0
if [ "$PWD" = "{workdir}" ] && [ "$(cat archive/index.txt)" = "$(printf 'a.log\\nb.log')" ] && [ ! -e a.log ] \\
   && [ "$(cat keep.txt)" = keep ] && [ "$(cat status.txt)" = done ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
"""


def harbor_task(root: Path, workdir: str) -> Path:
    folder = root / workdir.strip("/").replace("/", "-")
    files = {"instruction.md": f"Move the .log files of {workdir} into a new folder archive/, list them in "
                               "archive/index.txt and write done into status.txt.\n",
             "task.toml": 'version = "1.0"\n\n[verifier]\ntimeout_sec = 60.0\n\n[agent]\ntimeout_sec = 60.0\n',
             "environment/Dockerfile": f"FROM {BASE}\nWORKDIR {workdir}\nCOPY inbox/ ./\n",
             "environment/inbox/a.log": "a\n", "environment/inbox/b.log": "b\n", "environment/inbox/keep.txt": "keep\n",
             "tests/test.sh": TEST.format(workdir=workdir), "solution/solve.sh": SOLVE}
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def host_state() -> dict[str, object]:
    """Each work folder and the folders above it on the host: whether it exists, and what a folder holds."""
    paths = {"/".join(w.split("/")[:i]) for w in WORKDIRS for i in range(2, w.count("/") + 2)}
    return {p: sorted(os.listdir(p)) if os.path.isdir(p) else os.path.lexists(p) for p in sorted(paths)}


@pytest.mark.slow  # bwrap 1.4-3 s on a busy 2-core machine (6 tasks prepared, 12 episodes); buildah 11-13 s
@pytest.mark.parametrize("kind", BACKENDS)
def test_a_work_folder_anywhere_gives_the_same_rewards(kind, tmp_path):
    backend, before = make_backend(kind, tmp_path / "cache"), host_state()
    tasks = [read_task(harbor_task(tmp_path / "tasks", workdir)) for workdir in WORKDIRS]
    prepared = [backend.prepare(task.environment) for task in tasks]
    assert [p.workdir for p in prepared] == WORKDIRS

    async def episode(task, ready, solve: bool) -> float:
        session = await backend.start(ready, 120)
        try:
            if solve:
                await session.put(task.solution, "/solution")
                solved = await session.run("bash /solution/solve.sh")
                assert solved.exit_code == 0, (task.name, solved)
            return (await verify(session, task)).reward
        finally:
            await session.close()

    async def main():
        return await asyncio.gather(*(episode(t, p, solve) for t, p in zip(tasks, prepared) for solve in (True, False)))

    rewards = asyncio.run(main())
    assert dict(zip(WORKDIRS, zip(rewards[::2], rewards[1::2]))) == {w: (1.0, 0.0) for w in WORKDIRS}
    assert host_state() == before  # no /data, /srv/x, /home/user, ... made on the host
