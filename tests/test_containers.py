"""The CPU image builds with containers/build.sh and molt runs inside it (buildah, chroot isolation: see
containers/README.md).

Needs root, buildah and debootstrap (`apt-get install -y buildah debootstrap`; .ci/run installs them) and the Debian
mirror and PyPI during the build: skipped without the tools. From nothing (no base image, no layer cache) the build
takes about 7-10 minutes on 2 cores; with buildah's layer cache an unchanged tree rebuilds in seconds, and a changed
package only its last layers: `.ci/run` builds the image before the suite (set-up), so in CI this test rebuilds from
the cache. The commands run inside the image reach no network (HF_HUB_OFFLINE=1, the tiny policy is built into the
image).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "localhost/molt-lightning:test"  # not the :cpu tag build.sh makes by default, so a user's image stays


def _why_not() -> str | None:
    if os.name != "posix" or os.geteuid() != 0:
        return "building with buildah's chroot isolation needs root"
    for tool in ("buildah", "debootstrap"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install -y buildah debootstrap)"
    return None


pytestmark = [pytest.mark.slow, pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))]


def _run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert out.returncode == 0, f"{' '.join(cmd)} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def container():
    _run(["bash", "containers/build.sh"], timeout=2400, cwd=ROOT, env={**os.environ, "IMAGE": IMAGE})
    name = _run(["buildah", "from", "--quiet", IMAGE], timeout=120).stdout.strip()
    yield lambda *cmd, timeout=600: _run(["buildah", "run", "--isolation", "chroot", name, "--", *cmd], timeout)
    subprocess.run(["buildah", "rm", name], capture_output=True)


def test_molt_bench_runs_in_the_image(container):
    assert "/molt/protocols/arithmetic-" in container(".venv/bin/molt-bench", "protocols").stdout


def test_molt_fit_trains_two_steps_in_the_image(container):
    container(".venv/bin/molt", "fit", "--config", "recipes/default.yaml", "--trainer.max_steps", "2",
              "--model.engine", "molt_lightning.engines.TorchEngine",
              "--trainer.logger.init_args.save_dir", "/tmp/runs")
    read = "import pandas as pd; df = pd.read_csv('/tmp/runs/default/version_0/metrics.csv')"
    steps = container(".venv/bin/python", "-c", read + "; print(sorted(map(int, df.dropna(subset=['reward'])"
                      "['step'].unique())))")  # training rows (the recipe's evaluation logs at step 2 too)
    assert steps.stdout.strip() == "[0, 1]", steps.stdout
