"""``molt view`` in a real browser: headless Chromium (Debian's ``chromium`` and ``chromium-driver``, which
``.ci/run`` installs) driven by Selenium. A short run is trained here, ``molt view`` serves it, and the test goes from
a point of the reward curve to its step and to a sample by clicks, then checks what the page shows for a token
against the ``StepRecord`` the step handed its callbacks; the compare page's verdict against ``molt-bench compare``.
Screenshots are kept in the test's folder (``tmp_path``; ``MOLT_VIEW_SHOTS=DIR`` copies them there too).

Without Chromium the tests skip, except under CI (``CI`` set), where they fail: CI must run them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from molt_lightning.callbacks import Evaluate
from molt_lightning.engines import TorchEngine
from molt_lightning.tasks import arithmetic
from modules import make_module

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
DEADLINE = 60.0
pytestmark = pytest.mark.slow

if not (CHROMIUM and DRIVER):
    if os.environ.get("CI"):
        raise RuntimeError("CI runs the browser tests: apt-get install chromium chromium-driver (.ci/run does)")
    pytest.skip("no chromium/chromedriver (apt-get install chromium chromium-driver)", allow_module_level=True)


class KeepRecords(L.Callback):
    def __init__(self):
        self.records = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.records[pl_module.policy_version - 1] = outputs["record"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 6-step run of the default task (torch engine), with held-out rounds and a checkpoint; its StepRecords."""
    root = tmp_path_factory.mktemp("view_run")
    keep = KeepRecords()
    module = make_module(TorchEngine(seed=0), group_size=4, prompts_per_step=4, max_lag=1, lr=3e-4, task_seed=0)
    trainer = L.Trainer(max_steps=6, accelerator="cpu", logger=CSVLogger(root, name="run"), log_every_n_steps=1,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[keep, ModelCheckpoint(every_n_train_steps=3),
                                   Evaluate(arithmetic.tasks, seed=1000, max_prompts=8, k=2, every_n_steps=3)])
    trainer.fit(module)
    return Path(trainer.logger.log_dir), keep.records


@pytest.fixture(scope="module")
def runsets(tmp_path_factory):
    import importlib.util

    from molt_lightning.bench.protocol import load_protocol

    spec = importlib.util.spec_from_file_location("bench_conftest", Path(__file__).parent / "bench" / "conftest.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    write_runset = bench.write_runset
    root, protocol = tmp_path_factory.mktemp("view_sets"), load_protocol("arithmetic-smoke").data
    a = write_runset(root, "A", [0.80, 0.84, 0.82, 0.86], protocol, stack="a")
    b = write_runset(root, "B", [0.70, 0.72, 0.69, 0.73], protocol, stack="b")
    return a, b


@pytest.fixture(scope="module")
def server(trained, runsets):
    """``molt view RUN A B`` on a free port; its address, read from what it prints."""
    proc = subprocess.Popen([sys.executable, "-m", "molt_lightning.commands.cli", "view", str(trained[0]),
                             str(runsets[0]), str(runsets[1]), "--port", "0"], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # blocks until the server says where it listens (or exits)
    match = re.search(r"http://127\.0\.0\.1:\d+/", line)
    assert match, f"molt view printed {line!r} (exit {proc.poll()})"
    yield match.group(0)
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()


def wait(driver, condition, what: str):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, DEADLINE).until(condition, message=f"waited {DEADLINE:.0f} s for {what}")


def shot(driver, folder: Path, name: str) -> None:
    driver.save_screenshot(str(folder / f"{name}.png"))
    if os.environ.get("MOLT_VIEW_SHOTS"):
        Path(os.environ["MOLT_VIEW_SHOTS"]).mkdir(parents=True, exist_ok=True)
        shutil.copy(folder / f"{name}.png", Path(os.environ["MOLT_VIEW_SHOTS"]) / f"{name}.png")


def test_curve_point_to_step_to_sample_shows_the_step_records_values(server, browser, trained, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    _, records = trained
    browser.get(server + "run/0")
    points = wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#chart-0 .scatterlayer .trace:first-child "
                                                                        "path.point"), "the reward curve's points")
    assert len(points) == 6  # a point per step
    shot(browser, tmp_path, "overview")
    target = points[4]
    ActionChains(browser).move_to_element(target).pause(0.3).click().perform()
    wait(browser, lambda d: "/step/" in d.current_url, "the step page after clicking a point")
    step = int(re.search(r"/step/(\d+)$", browser.current_url).group(1))
    assert step == 4
    assert browser.find_element(By.TAG_NAME, "h1").text == "Step 4"
    shot(browser, tmp_path, "step")
    browser.find_elements(By.CSS_SELECTOR, "a.sample-link")[1].click()
    wait(browser, lambda d: "/sample/" in d.current_url, "the sample page")
    g, m = map(int, re.search(r"/sample/(-?\d+)/(\d+)$", browser.current_url).groups())
    tokens = browser.find_elements(By.CSS_SELECTOR, "#conversation .tok[data-kind='1']")
    assert tokens, "the sample shows its policy tokens"
    record = records[step]
    members = [t for t, traj in enumerate(record.batch.trajectories) if traj.group_id == g]
    rows = (record.batch.traj_ids == members[m]).nonzero().flatten().tolist()
    for tok in (tokens[0], tokens[-1]):
        tok.click()
        info = browser.find_element(By.ID, "tok-info").text
        row, j = rows[int(tok.get_attribute("data-segment"))], int(tok.get_attribute("data-i"))
        version = int(record.batch.versions[row, j])
        adv, trained_flag = float(record.advantages[row, j - 1]), bool(record.loss_mask[row, j - 1])
        assert int(tok.get_attribute("data-version")) == version and f"version {version} " in info
        assert float(tok.get_attribute("data-adv")) == pytest.approx(adv, abs=1e-4)
        assert f"advantage {tok.get_attribute('data-adv')}" in info
        assert tok.get_attribute("data-trained") == str(trained_flag)
        assert ("not trained" in info) != trained_flag
        assert int(record.batch.input_ids[row, j]) == int(tok.get_attribute("data-id"))
        assert int(tok.get_attribute("data-staleness")) == record.version - version
    select = browser.find_element(By.ID, "color-by")
    for value in ("staleness", "adv", "trained"):
        select.find_element(By.CSS_SELECTOR, f"option[value='{value}']").click()
        assert tokens[0].value_of_css_property("background-color") not in ("rgba(0, 0, 0, 0)", "")
    select.find_element(By.CSS_SELECTOR, "option[value='staleness']").click()
    shot(browser, tmp_path, "sample")


def test_timeline_and_search_pages_render(server, browser, tmp_path):
    from selenium.webdriver.common.by import By

    browser.get(server + "run/0/timeline")
    bars = wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#timeline .barlayer path"), "the timeline's bars")
    assert len(bars) >= 6 * 3  # three trainer phases a step at least (and the groups' generation)
    shot(browser, tmp_path, "timeline")
    browser.get(server + "run/0/samples?trained=true&min=1")
    count = browser.find_element(By.ID, "count").text
    rewards = [float(td.text) for td in browser.find_elements(By.CSS_SELECTOR, "#results tr td:nth-child(3)")]
    assert rewards and all(r >= 1 for r in rewards), count


def test_compare_page_gives_molt_bench_compares_verdict(server, browser, runsets, tmp_path):
    from selenium.webdriver.common.by import By

    done = subprocess.run([sys.executable, "-m", "molt_lightning.bench.cli", "compare", str(runsets[0]),
                           str(runsets[1]), "--metric", "reward"], capture_output=True, text=True, timeout=120)
    verdict = re.search(r"verdict: (.+)", done.stdout).group(1).strip()
    browser.get(server)
    boxes = browser.find_elements(By.CSS_SELECTOR, "#compare-form input[name=runs]")
    for box, want in zip(boxes, (False, True, True)):
        if box.is_selected() != want:
            box.click()
    browser.find_element(By.CSS_SELECTOR, "#compare-form button").click()
    shown = wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".verdict-text"), "the verdict")
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#compare-chart .scatterlayer .trace"), "the curves")
    assert shown[0].text == verdict
    assert len(browser.find_elements(By.CSS_SELECTOR, "#compare-chart .scatterlayer .trace")) == 8  # 4 seeds a side
    shot(browser, tmp_path, "compare")
