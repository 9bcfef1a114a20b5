"""``molt-bench reproduce``: the registry of reported results is complete and runnable, each README names the
command for each of its results, and a reproduction writes the reported numbers next to the reproduced ones."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import yaml

from molt_lightning.bench import reproduce, runs
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


def test_a_recipe_report_holds_the_heldout_rounds_and_the_cpu(tmp_path):
    """The default run's entry reads held-out avg@4 before and after from eval.jsonl; every report names the CPU
    model (/proc/cpuinfo's, not platform.processor(), which is empty on Linux), the CPU count and the date."""
    run = tmp_path / "default" / "version_0"
    run.mkdir(parents=True)
    (run / "metrics.csv").write_text("step,reward\n0,0.1\n1,0.3\n2,0.5\n3,0.7\n")
    metrics = lambda m, lo, hi: {"arith": {"avg@4": m, "avg@4_lo": lo, "avg@4_hi": hi}}  # noqa: E731
    (run / "eval.jsonl").write_text("\n".join(json.dumps(r) for r in (
        {"step": 0, "version": 0, "k": 4, "metrics": metrics(0.125, 0.0625, 0.1875)},
        {"step": 2, "version": 2, "k": 4, "metrics": metrics(0.5, 0.375, 0.625)},
        {"step": 4, "version": 4, "k": 4, "metrics": metrics(0.9375, 0.875, 1.0)})) + "\n")
    spec = {"kind": "recipe", "run_dir": str(tmp_path / "default"), "windows": [[0, 2], [2, 4]], "heldout": True}
    line = reproduce.from_recipe(spec, "")
    assert "reward steps 0-1: 0.200 | reward steps 2-3: 0.600" in line
    assert "held-out avg@4 (source arith) 0.125 [0.062, 0.188] (version 0) -> 0.938 [0.875, 1.000] (version 4)" in line
    assert reproduce.registry()["default-run"]["extract"]["heldout"] is True

    report = reproduce._report("x", {"where": "README.md", "reported": "r"}, [], line)
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((x.split(":", 1)[1].strip() for x in cpuinfo.splitlines() if x.startswith("model name")), None)
    if model is None:
        pytest.skip("no x86 /proc/cpuinfo here: test_cpu_model_reads_cpuinfo covers the parsing")
    assert f"- machine: {model}, {os.cpu_count()} CPUs" in report
    assert re.search(r"- date: \d{4}-\d\d-\d\dT", report)


def test_cpu_model_reads_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C\n")
    assert runs.cpu_model(info) == "Intel(R) Xeon(R) Platinum 8481C"
    info.write_text("processor\t: 0\nBogoMIPS\t: 50.00\n\nHardware\t: BCM2835\nModel\t: Raspberry Pi 4 Model B\n")
    assert runs.cpu_model(info) == "BCM2835"
