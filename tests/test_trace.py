"""The run's record (``callbacks.trace``, ``trace.jsonl.gz``): what a short run writes (a ``run`` entry, one ``step``
entry per step, ``eval`` and ``checkpoint`` entries), per-token values equal to the ``StepRecord`` the step handed the
callbacks, token selection's untrained policy tokens, failed samples as ``outcast`` entries, a resumed run appending
to the same file, no file without a logger; and ``read`` on torn and garbled files (every cut point of a member).

The runs use the torch engine (the record is trainer-side); the ones that train are ``slow`` (the fast tier trains
nothing). Values in the file are rounded to 4 decimals: compared at 1e-4."""

from __future__ import annotations

import gzip
import json
import random
import shutil
import sys
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from molt_lightning.algorithms import Algorithm
from molt_lightning.callbacks import Evaluate, RunTrace
from molt_lightning.callbacks import trace
from molt_lightning.callbacks.trace import FILENAME, read
from molt_lightning.engines import TorchEngine
from molt_lightning.tasks.arithmetic import calculator_agent, tasks

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from modules import make_module  # noqa: E402

STEPS = 3
PER_TOKEN = {"engine_lp": "engine_logprobs", "trainer_lp": "logprobs", "adv": "advantages", "entropy": "entropy",
             "is_weight": "is_weight"}  # the file's per-token arrays -> the StepRecord's (N, T-1) tensors


class Records(L.Callback):
    """What each step handed the callbacks (the same object RunTrace built its entry from)."""

    def __init__(self):
        self.records = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.records.append(outputs["record"])


def module(**kw):
    return make_module(**{**dict(engine=TorchEngine(seed=0), group_size=4, prompts_per_step=4, max_lag=1, lr=3e-4,
                                 task_seed=0), **kw})


def fit(m, root: Path, steps: int, callbacks=(), logger=True, ckpt_path=None) -> L.Trainer:
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", log_every_n_steps=1, default_root_dir=root,
        logger=CSVLogger(root, name="run", version=0) if logger else False,  # version 0: a resumed run reuses it
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks), callbacks=list(callbacks),
        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(m, ckpt_path=ckpt_path)
    return trainer


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """3 steps with top-entropy selection (half the policy tokens), held-out rounds at start and end, a checkpoint
    every step."""
    root, records = tmp_path_factory.mktemp("trace"), Records()
    m = module(algo=Algorithm(token_selection="top_entropy", top_entropy_share=0.5))
    callbacks = [records, Evaluate(tasks, k=1, seed=99, max_prompts=2),
                 ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1, save_last=True)]
    trainer = fit(m, root, STEPS, callbacks)
    entries, skipped = read(Path(trainer.logger.log_dir) / FILENAME)
    return {"root": root, "records": records.records, "module": m, "entries": entries, "skipped": skipped,
            "log_dir": Path(trainer.logger.log_dir)}


def of_type(entries, kind: str) -> list[dict]:
    return [e for e in entries if e["type"] == kind]


@pytest.mark.slow
def test_a_short_run_writes_its_run_steps_evals_and_checkpoints(run):
    entries, records = run["entries"], run["records"]
    assert run["skipped"] == 0 and entries[0]["type"] == "run"
    assert {e["type"] for e in entries} == {"run", "step", "eval", "checkpoint"}
    start = entries[0]
    assert (start["step"], start["version"], start["group_size"], start["prompts_per_step"], start["max_lag"]) == (
        0, 0, 4, 4, 1)
    assert start["token_selection"] == "top_entropy" and start["temperature"] == 1.0
    steps = of_type(entries, "step")
    assert [s["step"] for s in steps] == list(range(STEPS)) == [r.version for r in records]
    for s, r in zip(steps, records):
        assert s["version"] == r.version and s["sync"]["version"] == r.version + 1 and s["sync"]["verified"] == 1.0
        assert s["start"] < s["end"] and s["phases"]["train"] == pytest.approx(r.train_compute_s)
        assert s["phases"]["wait_rollouts"] == pytest.approx(r.trainer_idle_s)
        # the batch in brief: every group and member the step trained on; the logged reward is this step's
        rewards = [t.reward for t in r.batch.trajectories]
        assert sorted(g["group"] for g in s["batch"]) == sorted({t.group_id for t in r.batch.trajectories})
        assert sum(len(g["rewards"]) for g in s["batch"]) == len(rewards) == 16
        assert s["metrics"]["reward"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-6)
        assert 0 < s["metrics"]["select/kept_frac"] < 1
        assert len(s["groups"]) == 2  # groups_per_step
    assert all(a["end"] <= b["start"] + 1e-6 for a, b in zip(steps, steps[1:]))  # one after the other

    # held-out rounds at start (version 0) and end (the last step's weights), as Evaluate wrote them to eval.jsonl
    evals = of_type(entries, "eval")
    written = [json.loads(x) for x in (run["log_dir"] / "eval.jsonl").read_text().splitlines()]
    assert [(e["step"], e["version"]) for e in evals] == [(r["step"], r["version"]) for r in written] == [
        (0, 0), (STEPS, STEPS)]
    assert [e["metrics"] for e in evals] == [r["metrics"] for r in written]
    for e in evals:
        assert len(e["samples"]) == 2 and all(s["member"] == "eval0" for s in e["samples"])
        assert all(s["spans"][0]["kind"] == 0 and any(sp["kind"] == 1 for sp in s["spans"]) for s in e["samples"])
    assert entries.index(evals[0]) < entries.index(steps[0]) and entries[-1] == evals[-1]  # at start, at end

    # a checkpoint after every step (ModelCheckpoint's step file and last.ckpt: one entry per file it saved)
    ckpts = of_type(entries, "checkpoint")
    assert sorted({(c["step"], c["version"]) for c in ckpts}) == [(s, s + 1) for s in range(STEPS)]
    for c in ckpts:  # written after its step's entry
        assert entries.index(c) > entries.index(steps[c["step"]])


def rows_of(batch, group: int, member) -> list[int]:
    """The batch rows of a group's member, in order (one per segment that holds policy tokens)."""
    t_idx = next(i for i, t in enumerate(batch.trajectories) if t.group_id == group and t.member == member)
    return [row for row, t in enumerate(batch.traj_ids.tolist()) if t == t_idx]


@pytest.mark.slow
def test_per_token_values_are_the_step_records(run):
    """Token j of a recorded segment is position j of its batch row; its per-position values (the loss's, shifted:
    position j - 1 holds token j's) are the record's; the policy tokens carry them, every other token null."""
    tokenizer, checked = run["module"].tokenizer, 0
    for step, record in zip(of_type(run["entries"], "step"), run["records"]):
        batch = record.batch
        for g in step["groups"]:
            for m in g["members"]:
                traj = next(t for t in batch.trajectories if t.group_id == g["group"] and t.member == m["member"])
                assert (m["sample_id"], m["reward"], m["status"]) == (traj.sample_id, traj.reward, traj.status.value)
                rows = rows_of(batch, g["group"], m["member"])
                assert len(m["segments"]) == len(rows) >= 1
                for seg, row in zip(m["segments"], rows):
                    n = int(batch.attention_mask[row].sum())
                    assert seg["tokens"] == batch.input_ids[row, :n].tolist()
                    assert "".join(seg["text"]) == tokenizer.decode(seg["tokens"])
                    assert all(len(seg[k]) == n for k in ("text", "kind", "trained", "version", *PER_TOKEN))
                    for j in range(n):
                        policy = j > 0 and bool(record.policy_mask[row, j - 1])
                        assert (seg["kind"][j] == 1) == policy, (row, j)
                        if not policy:
                            assert seg["version"][j] is None and all(seg[k][j] is None for k in PER_TOKEN)
                            assert seg["trained"][j] in (None, False)
                            continue
                        assert seg["version"][j] == int(batch.versions[row, j])
                        assert seg["trained"][j] == bool(record.loss_mask[row, j - 1])
                        for name, field in PER_TOKEN.items():
                            want = float(getattr(record, field)[row, j - 1])
                            assert seg[name][j] == pytest.approx(want, abs=1e-4), (name, row, j)
                        checked += 1
    assert checked > 100


@pytest.mark.slow
def test_token_selection_shows_as_untrained_policy_tokens(run):
    kinds = trained = 0
    for step in of_type(run["entries"], "step"):
        for seg in (s for g in step["groups"] for m in g["members"] for s in m["segments"]):
            flags = [t for k, t in zip(seg["kind"], seg["trained"]) if k == 1]
            kinds += len(flags)
            trained += sum(flags)
            assert not any(t for k, t in zip(seg["kind"], seg["trained"]) if k != 1)  # context: never trained
    assert 0 < trained < kinds  # top_entropy at 0.5 left some sampled tokens out of the loss


async def fails_member_0(client, sample):
    """Member 0 of each group fails (its trajectory is an outcast), the others answer."""
    reward = await calculator_agent(client, sample)
    if client.trajectory.member == 0:
        raise RuntimeError("the tool crashed on purpose")
    return reward


@pytest.mark.slow
def test_failed_samples_are_outcasts_with_their_reason(tmp_path):
    records = Records()
    trainer = fit(module(agent=fails_member_0, prompts_per_step=2), tmp_path, 2, [records])
    entries, skipped = read(Path(trainer.logger.log_dir) / FILENAME)
    outcasts = of_type(entries, "outcast")
    assert skipped == 0 and outcasts
    for o in outcasts:
        assert (o["cause"], o["status"], o["member"]) == ("failed", "failed", 0)
        assert "agent raised RuntimeError: the tool crashed on purpose" in o["reason"]
        assert o["spans"][0]["kind"] == 0 and any(s["kind"] == 1 and s.get("versions") for s in o["spans"])
    per_step = [sum(o["step"] == s for o in outcasts) for s in range(2)]
    assert per_step[0] >= 1 and max(per_step) <= 8  # the failures of each group, at most outcasts_per_step a step
    trained = {(t.sample_id, t.member) for r in records.records for t in r.batch.trajectories}
    assert not trained & {(o["sample_id"], o["member"]) for o in outcasts}
    for step in of_type(entries, "step"):  # the batch: the 3 healthy members of each group
        assert all(g["statuses"] == ["ok"] * 3 for g in step["batch"]), step["batch"]


@pytest.mark.slow
def test_a_resumed_run_appends_to_the_same_file_after_a_torn_member(run, tmp_path):
    """The first run killed mid-write (its last member cut) then resumed from its checkpoint at step 3 in the same
    folder: the file holds both runs, the torn member skipped."""
    log_dir = tmp_path / "run" / "version_0"
    shutil.copytree(run["log_dir"], log_dir)
    path = log_dir / FILENAME
    data, last = path.read_bytes(), len(members(run["entries"][-1:])[0])  # the last member's length
    path.write_bytes(data[: len(data) - last // 2])
    before, _ = read(path)
    assert before == run["entries"][:-1]

    records = Records()
    fit(module(algo=Algorithm(token_selection="top_entropy", top_entropy_share=0.5)), tmp_path, STEPS + 2, [records],
        ckpt_path=str(run["root"] / "ckpt" / "last.ckpt"))
    entries, skipped = read(path)
    assert skipped == 1 and entries[: len(before)] == before
    after = entries[len(before):]
    assert after[0]["type"] == "run" and (after[0]["step"], after[0]["version"]) == (STEPS, STEPS)
    assert [e["type"] for e in entries].count("run") == 2
    assert [e["step"] for e in of_type(after, "step")] == [STEPS, STEPS + 1] == [r.version for r in records.records]


@pytest.mark.slow
def test_no_logger_no_file_and_a_reused_callback_does_not_write_into_its_last_run(tmp_path):
    callback = RunTrace()
    first = fit(module(), tmp_path / "logged", 1, [callback])
    path = Path(first.logger.log_dir) / FILENAME
    written = path.read_bytes()
    assert [e["type"] for e in read(path)[0]] == ["run", "step"]

    trainer = fit(module(), tmp_path / "quiet", 1, [callback], logger=False)
    assert trainer.global_step == 1 and callback in trainer.callbacks
    assert list(tmp_path.rglob(FILENAME)) == [path] and path.read_bytes() == written

    trainer = fit(module(), tmp_path / "default", 1, logger=False)
    assert trainer.global_step == 1 and not list((tmp_path / "default").rglob(FILENAME))
    assert next(c for c in trainer.callbacks if isinstance(c, RunTrace)).path is None


# ----- read: torn and garbled files -----

@pytest.fixture(params=[5, "default"])
def chunk(request, monkeypatch):
    """``read`` feeds the decompressor a chunk at a time: members across chunks (5 bytes), and the default."""
    if request.param != "default":
        monkeypatch.setattr(trace, "READ_CHUNK", request.param)


ENTRIES = [{"type": "run", "step": 0}, {"type": "step", "step": 0, "text": "x" * 300}, {"type": "step", "step": 1}]


def members(entries=ENTRIES) -> list[bytes]:
    """The members RunTrace.write appends, one per entry."""
    return [gzip.compress((json.dumps(e) + "\n").encode(), compresslevel=6, mtime=0) for e in entries]


def test_write_appends_one_member_per_entry_that_read_returns(tmp_path, chunk):
    writer = RunTrace()
    writer.path = tmp_path / FILENAME
    for e in ENTRIES:
        writer.write(e)
    assert writer.path.read_bytes() == b"".join(members())
    assert read(writer.path) == (ENTRIES, 0)
    assert gzip.decompress(writer.path.read_bytes()).decode().splitlines() == [json.dumps(e) for e in ENTRIES]


@pytest.mark.parametrize("torn", [1, 2])
def test_a_member_cut_at_any_byte_is_skipped_alone(tmp_path, torn, chunk):
    """Member ``torn`` cut after each of its byte counts: the last one (a run killed mid-write) or the middle one
    followed by more (a resumed run appended after it): every other entry is read, one member skipped."""
    parts, path = members(), tmp_path / FILENAME
    for keep in range(len(parts[torn])):
        cut = parts[:torn] + [parts[torn][:keep]] + parts[torn + 1:]
        path.write_bytes(b"".join(cut))
        want = ENTRIES[:torn] + ENTRIES[torn + 1:]
        assert read(path) == (want, 1 if keep else 0), keep


def test_garbage_is_counted_never_raised(tmp_path, chunk):
    parts, path, rng = members(), tmp_path / FILENAME, random.Random(0)
    junk = bytes(rng.randrange(256) for _ in range(500)).replace(b"\x1f\x8b", b"\x1f\x00")  # no false header
    for data, want in [
        (junk, []),
        (junk + b"".join(parts), ENTRIES),
        (parts[0] + junk + b"".join(parts[1:]), ENTRIES),
        (b"".join(parts) + junk, ENTRIES),
        (b"".join(parts) + b"\x1f\x8b\x08", ENTRIES),  # a header and nothing more
        (b"".join(parts) + b"\x00" * 64, ENTRIES),  # a file system's zeros after a crash
    ]:
        path.write_bytes(data)
        assert read(path) == (want, 1), data[:20]
    not_json = gzip.compress(b"{not json\n", mtime=0)
    path.write_bytes(parts[0] + not_json + parts[1])
    assert read(path) == (ENTRIES[:2], 1)
    path.write_bytes(b"")
    assert read(path) == ([], 0)


def test_a_character_split_over_tokens_is_given_whole_to_its_first_token():
    """Byte-level BPE: each byte of a multi-byte character decodes alone to U+FFFD; the piece holds the character."""

    class Bytes:  # a tokenizer whose ids are UTF-8 bytes
        def decode(self, ids):
            return bytes(ids).decode(errors="replace")

    ids = list("né 日".encode())
    pieces = RunTrace()._text(ids, Bytes())
    assert pieces == ["n", "é", "", " ", "日", "", ""] and "".join(pieces) == "né 日"
