"""``molt-bench reproduce``: the registry of reported results is complete and runnable, each README names the
command for each of its results, and a reproduction writes the reported numbers next to the reproduced ones."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml

from molt_lightning.bench import reproduce
from molt_lightning.bench.cli import main
from molt_lightning.bench.protocol import PROTOCOL_DIR

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tests/ is no package: test_docs's heading slugs, by import
from tests.test_docs import anchors  # noqa: E402


def test_registry_entries_are_complete_and_point_at_what_exists():
    entries = reproduce.registry()
    assert len(entries) >= 8
    for name, e in entries.items():
        assert {"where", "commands", "extract", "reported", "minutes"} <= set(e), name
        assert e["extract"]["kind"] in reproduce.EXTRACT, name
        readme = ROOT / reproduce.locations(e)[0].partition("#")[0]
        assert f"molt-bench reproduce {name}" in readme.read_text(), f"{readme} does not name the command for {name}"
        for command in e["commands"]:
            assert set(re.findall(r"{(\w+)}", command)) <= {"out", "real_logs"}, command
            for path in re.findall(r"(?:recipes|benchmarks)/[\w./-]+\.(?:yaml|py)", command):
                assert (ROOT / path).exists(), (name, path)
            for proto in re.findall(r"--protocol (\S+)|run (\S+) --stack", command):
                ref = next(p for p in proto if p)
                assert (PROTOCOL_DIR / f"{ref}.yaml").exists(), (name, ref)


def test_every_location_is_a_file_and_a_heading_there():
    """`reproduce --list` prints `where`: each FILE exists, and each #anchor is a heading's slug in it."""
    problems = []
    for name, e in reproduce.registry().items():
        for where in reproduce.locations(e):
            file, _, anchor = where.partition("#")
            if not (ROOT / file).is_file():
                problems.append(f"{name}: {where}: no such file")
            elif anchor and anchor not in anchors((ROOT / file).resolve()):
                problems.append(f"{name}: {where}: no heading with this anchor in {file}")
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_reproduce_a_recipe_run_from_a_registry(tmp_path, capsys):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump({
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "max_steps": 3, "enable_progress_bar": False, "log_every_n_steps": 1,
                    "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                               "init_args": {"save_dir": "runs", "name": "tiny"}}},
        "model": {"engine": {"class_path": "molt_lightning.engines.TorchEngine"},
                  "agent": "molt_lightning.tasks.arithmetic.calculator_agent",
                  "tasks": "molt_lightning.tasks.arithmetic.tasks",
                  "rollout": {"group_size": 4, "prompts_per_step": 2}, "torch_threads": 1}}))
    registry = tmp_path / "reported.yaml"
    registry.write_text(yaml.safe_dump({"tiny-run": {
        "where": "a test", "minutes": 1, "reported": "reward 0.1 -> 0.2\n",
        "commands": [f".venv/bin/molt fit --config {recipe} --trainer.logger.init_args.save_dir {{out}}"],
        "extract": {"kind": "recipe", "run_dir": "{out}/tiny", "windows": [[0, 1], [1, 3]], "threshold": 0.0}}}))
    assert main(["reproduce", "tiny-run", "--registry", str(registry), "--out", str(tmp_path / "rep")]) == 0
    report = (tmp_path / "rep" / "report.md").read_text()
    assert "reward 0.1 -> 0.2" in report  # the reported block, verbatim
    line = report.split("## Reproduced")[1].split("```")[1]
    assert re.search(r"reward steps 0-0: \d\.\d{3} \| reward steps 1-2: \d\.\d{3}", line), line
    assert "5-step mean >= 0.0 at step" in line and "steps 3" in line and "exit 0" in report
    with pytest.raises(SystemExit):
        main(["reproduce", "--registry", str(registry), "nope", "--bad-flag"])


@pytest.mark.skipif(not (reproduce.real_logs() / "README.md").exists(), reason="../shared/real-logs not found")
@pytest.mark.slow
def test_reproduce_the_real_logs_example_agrees_with_the_readme(tmp_path):
    path = reproduce.reproduce("real-logs-verl-sp-vs-dp", tmp_path / "rep", log=lambda *_: None)
    report = path.read_text()
    reproduced = report.split("## Reproduced")[1].split("```")[1]
    assert "reward: mean A 0.5059, mean B 0.5255, inconclusive: about 20 seeds per side needed" in reproduced
    assert "step_time_s: mean A 7.417, mean B 9.497, A better" in reproduced
    assert "tokens_per_s_per_device: mean A 1676, mean B 2471, B better" in reproduced
