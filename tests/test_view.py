"""``molt view`` without a browser (Starlette's test client): safe by default (loopback, a token for other hosts,
nothing outside the folders given), clear notes instead of stack traces for folders that are not runs, runs of an
older version and torn records, a run still going followed as it grows, the sample search's filters."""

from __future__ import annotations

import gzip
import json
import os
import shutil

import pytest
from starlette.testclient import TestClient

from molt_lightning.callbacks.trace import FILENAME, FORMAT
from molt_lightning.commands.cli import main as molt
from molt_lightning.view.server import app


def member(entry: dict) -> bytes:
    return gzip.compress((json.dumps(entry) + "\n").encode())


def step_entry(step: int, reward: float, text: str = "ANSWER 4") -> dict:
    """A step as RunTrace writes it: one recorded group of two members, one token each after a prompt token."""
    seg = {"tokens": [1, 2], "text": ["Q", text], "kind": [0, 1], "trained": [None, True], "version": [None, step],
           "engine_lp": [None, -0.5], "trainer_lp": [None, -0.4], "adv": [None, 0.25], "entropy": [None, 1.0],
           "is_weight": [None, 1.1]}
    members = [{"sample_id": step, "member": m, "reward": reward, "status": "ok", "reason": "", "truncation": None,
                "turns": 1, "tool_turns": 0, "policy_tokens": 1, "started": 1.0, "ended": 2.0, "info": {},
                "segments": [seg]} for m in range(2)]
    return {"type": "step", "step": step, "version": step, "start": 10.0 + step, "end": 11.0 + step,
            "phases": {"wait_rollouts": 0.1, "train": 0.5, "weight_sync": 0.01}, "sync": None,
            "metrics": {"reward": reward, "lag": 1.0},
            "batch": [{"group": step, "sample_id": step, "rewards": [reward, reward], "statuses": ["ok", "ok"],
                       "tokens": [1, 1], "started": 10.0, "ended": 10.5}],
            "groups": [{"group": step, "sample_id": step, "members": members}]}


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run" / "version_0"
    d.mkdir(parents=True)
    (d / FILENAME).write_bytes(member({"type": "run", "format": FORMAT, "step": 0})
                               + b"".join(member(step_entry(s, s / 4, "ANSWER 4" if s % 2 else "CALC 2+2"))
                                          for s in range(4)))
    return d


def test_every_page_of_a_run_renders_and_urls_name_no_path(run_dir, tmp_path):
    (tmp_path / "secret.txt").write_text("not for the viewer")
    client = TestClient(app([str(run_dir)]))
    for url in ("/", "/run/0", "/run/0/step/2", "/run/0/step/2/sample/2/1", "/run/0/timeline", "/run/0/samples",
                "/api/run/0/curves", "/static/view.js", "/static/plotly.min.js"):
        assert client.get(url).status_code == 200, url
    page = client.get("/run/0/step/2/sample/2/1").text
    assert 'data-version="2"' in page and 'data-adv="0.25"' in page and 'data-trained="True"' in page
    for url in ("/static/../secret.txt", "/static/..%2f..%2fsecret.txt", "/static/%2e%2e/secret.txt", "/run/1",
                "/run/0/../../secret.txt", "/run/-1", f"/{tmp_path}/secret.txt", "/static/runs.py"):
        response = client.get(url)
        assert response.status_code == 404 and "not for the viewer" not in response.text, url
    assert client.get("/run/0/step/99").status_code == 200  # a step not recorded: a note, not an error
    assert "not in this run's record" in client.get("/run/0/step/99").text


def test_another_host_needs_a_token_and_every_request_carries_it(run_dir, capsys):
    with pytest.raises(SystemExit) as e:
        molt(["view", str(run_dir), "--host", "0.0.0.0"])
    assert e.value.code == 2 and "add --token" in capsys.readouterr().err
    client = TestClient(app([str(run_dir)], token="s3cret"))
    assert client.get("/run/0").status_code == 403
    assert client.get("/run/0?token=wrong").status_code == 403
    assert client.get("/run/0?token=s3cret").status_code == 200
    assert client.get("/run/0/step/1").status_code == 200  # the cookie set by the first answer


def test_folders_that_are_not_runs_older_runs_and_torn_records_get_notes(run_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    old = tmp_path / "old"
    old.mkdir()
    (old / "metrics.csv").write_text("step,reward,lag\n0,0.1,1\n1,0.3,1\n1,,\n2,0.5,1\n")
    torn = tmp_path / "torn"
    torn.mkdir()
    steps = [member(step_entry(s, s / 4)) for s in range(4)]
    data = member({"type": "run", "format": FORMAT}) + steps[0] + steps[1] + steps[2][:30] + steps[3]  # 2 torn
    (torn / FILENAME).write_bytes(data)
    os.utime(torn / FILENAME, (1, 1))  # written long ago: not a run still going
    client = TestClient(app([str(empty), str(old), str(torn)]))
    assert "is not a run folder" in client.get("/run/0").text
    page = client.get("/run/1").text
    assert "a run of an older version" in page
    curves = client.get("/api/run/1/curves").json()
    assert curves["charts"][0]["series"][0]["y"] == [0.1, 0.3, 0.5] and not curves["clickable"]
    page = client.get("/run/2").text
    assert "1 entries of the record could not be read" in page
    assert client.get("/api/run/2/curves").json()["charts"][0]["series"][0]["x"] == [0, 1, 3]
    (torn / FILENAME).write_bytes(data[:-10])  # the last entry cut short at the end of the file
    os.utime(torn / FILENAME, (1, 1))
    client = TestClient(app([str(torn)]))
    assert "ends inside an entry" in client.get("/run/0").text
    (torn / "trace.jsonl.gz").write_bytes(member({"type": "run", "format": FORMAT + 1}) + member(step_entry(0, 1.0)))
    assert "format [2]" in TestClient(app([str(torn)])).get("/run/0").text


def test_a_run_still_going_is_followed_as_its_record_grows(run_dir):
    client = TestClient(app([str(run_dir)]))
    assert client.get("/api/run/0/curves").json()["live"] is True
    assert client.get("/api/run/0/curves").json()["charts"][0]["series"][0]["x"] == [0, 1, 2, 3]
    with open(run_dir / FILENAME, "ab") as f:
        f.write(member(step_entry(4, 1.0)))
    assert client.get("/api/run/0/curves").json()["charts"][0]["series"][0]["x"] == [0, 1, 2, 3, 4]
    assert "Step 4" in client.get("/run/0/step/4").text


def test_search_filters_by_reward_status_and_text(run_dir):
    client = TestClient(app([str(run_dir)]))
    page = client.get("/run/0/samples").text
    assert "8 of 8 recorded samples" in page
    assert "4 of 8 recorded samples" in client.get("/run/0/samples?min=0.5").text  # steps 2 and 3, two members each
    assert "4 of 8 recorded samples" in client.get("/run/0/samples?text=calc").text  # steps 0 and 2
    assert "2 of 8 recorded samples" in client.get("/run/0/samples?text=calc&min=0.5").text
    assert "0 of 8 recorded samples" in client.get("/run/0/samples?status=failed").text


def test_a_folder_of_runs_stands_for_its_runs_and_bad_folders_are_refused(run_dir, tmp_path, capsys):
    shutil.copytree(run_dir, run_dir.parent / "version_10")
    (run_dir.parent / "version_2").mkdir()
    (run_dir.parent / "version_2" / "metrics.csv").write_text("step,reward\n0,0.5\n")
    page = TestClient(app([str(run_dir.parent)])).get("/").text
    assert page.index("run/version_0") < page.index("run/version_2") < page.index("run/version_10")
    with pytest.raises(SystemExit) as e:
        molt(["view", str(tmp_path / "nope")])
    assert e.value.code == 2 and "not a folder" in capsys.readouterr().err
