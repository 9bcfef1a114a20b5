"""Tasks from data (``molt_lightning.data.sources``): every file format and a ``datasets`` folder, templates, system
prompts and tools, reasoning-gym and generator sources, mixing by weight, per-epoch shuffling, a resumed run that
continues mid-epoch without repeating or skipping a row, and every bad-data error naming the file, row and field."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from molt_lightning.data import Source, Tasks
from molt_lightning.data.sources import prompt_key

ROWS = [{"question": f"What is {i}+{i}?", "answer": 2 * i, "level": i % 3} for i in range(12)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def jsonl(tmp_path) -> Path:
    return write_jsonl(tmp_path / "train.jsonl", ROWS)


def questions(tasks: Tasks, seed: int = 0) -> list[str]:
    return [s["messages"][-1]["content"] for s in tasks(seed)]


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "csv", "arrow", "folder", "dict-folder"])
def test_every_format_reads_the_same_samples(tmp_path, kind):
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    path = tmp_path / f"data.{kind}"
    split = None
    if kind == "jsonl":
        write_jsonl(path, ROWS)
    elif kind == "json":
        path.write_text(json.dumps(ROWS))
    elif kind == "parquet":
        ds.to_parquet(str(path))
    elif kind == "csv":
        ds.to_csv(str(path), index=False)
    elif kind == "arrow":
        ds.save_to_disk(str(tmp_path / "saved"))
        path = next((tmp_path / "saved").glob("*.arrow"))
    elif kind == "folder":
        ds.save_to_disk(str(path))
    else:
        datasets.DatasetDict({"train": ds, "test": ds.select(range(2))}).save_to_disk(str(path))
        split = "train"
    tasks = Tasks([Source(path=str(path), prompt="question", split=split)], shuffle=False)
    samples = list(tasks(0))
    assert [s["messages"] for s in samples] == [[{"role": "user", "content": r["question"]}] for r in ROWS]
    assert [int(s["answer"]) for s in samples] == [r["answer"] for r in ROWS]
    assert [s["row"] for s in samples] == list(range(12)) and {s["source"] for s in samples} == {path.stem}
    assert samples[3]["level"] == 0 and samples[0]["verifier"] == "exact"


def test_template_system_prompt_and_tools(tmp_path):
    tool = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {}}}}
    rows = [{"q": "2+2", "answer": 4, "tools": [tool]}, {"q": "3+3", "answer": 6, "tools": json.dumps([tool])}]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    tasks = Tasks([Source(path=str(path), template="Compute {q}. Reply {{briefly}}.", system="Be exact.",
                          tools="tools", verifier="math", name="calc")], shuffle=False)
    first, second = tasks(0)
    assert first["messages"] == [{"role": "system", "content": "Be exact."},
                                 {"role": "user", "content": "Compute 2+2. Reply {briefly}."}]
    assert first["tools"] == [tool] and second["tools"] == [tool]  # a JSON text is read as the list it holds
    assert first["source"] == "calc" and first["verifier"] == "math"


def test_chat_messages_as_the_prompt(tmp_path):
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": chat, "answer": "x"}])
    [sample] = Tasks([Source(path=str(path))])(0)
    assert sample["messages"] == chat


def test_each_epoch_is_a_seeded_permutation(jsonl):
    tasks = Tasks([Source(path=str(jsonl), prompt="question")])
    epochs = [questions(tasks, seed) for seed in range(3)]
    everything = sorted(r["question"] for r in ROWS)
    assert all(sorted(e) == everything for e in epochs)  # every row once per epoch
    assert epochs[0] != epochs[1] != epochs[2]  # reshuffled
    assert questions(tasks, 1) == epochs[1]  # a pure function of the seed (what resuming relies on)
    assert questions(Tasks([Source(path=str(jsonl), prompt="question")], shuffle=False)) == \
        [r["question"] for r in ROWS]


def test_sources_mix_by_weight(tmp_path, jsonl):
    other = write_jsonl(tmp_path / "other.jsonl", [{"question": f"Q{i}", "answer": i} for i in range(4)])
    tasks = Tasks([Source(path=str(jsonl), prompt="question", weight=3),
                   Source(path=str(other), prompt="question", weight=1)], epoch_size=40)
    counts = [Counter(s["source"] for s in tasks(seed)) for seed in range(2)]
    assert counts[0] == counts[1] == {"train": 30, "other": 10}  # exact shares per epoch
    rows = Counter(s["row"] for s in tasks(0) if s["source"] == "other")
    assert sorted(rows.values()) == [2, 2, 3, 3]  # 10 draws from 4 rows: whole shuffled passes, then part of one
    train = Counter(s["row"] for s in tasks(0) if s["source"] == "train")
    assert max(train.values()) - min(train.values()) <= 1
    assert len(tasks) == 40


def test_reasoning_gym_and_generator_sources():
    pytest.importorskip("reasoning_gym")
    tasks = Tasks([Source(reasoning_gym="chain_sum", size=20, seed=3, config={"min_terms": 2, "max_terms": 2}),
                   Source(generator="data_helpers.rows", size=5, name="gen")],
                  shuffle=False)
    samples = list(tasks(0))
    rg, gen = samples[:20], samples[20:]
    assert all(s["verifier"] == "reasoning_gym" and s["metadata"]["source_dataset"] == "chain_sum" for s in rg)
    assert rg[0]["messages"][0]["content"] == rg[0]["question"]
    assert [s["answer"] for s in gen] == [str(2 * i) for i in range(5)] and gen[0]["source"] == "gen"
    held_out = Tasks([Source(reasoning_gym="chain_sum", size=20, seed=4, config={"min_terms": 2, "max_terms": 2})])
    assert {prompt_key(s) for s in held_out(0)} != tasks.keys()


@pytest.mark.slow
def test_a_resumed_run_continues_mid_epoch_without_repeats_or_gaps(tmp_path, jsonl, policy_path):
    """Train 4 steps of 4 prompts (epoch: 12 rows), checkpoint after step 2, resume to step 5: the steps that count
    (the audit's replay) trained the prompts of an uninterrupted stream: every row once in epoch 0, then epoch 1."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from molt_lightning import AsyncRLModule, Rollout
    from molt_lightning.callbacks import SampleAudit
    from molt_lightning.callbacks.audit import replay
    from molt_lightning.agents import Answer
    from molt_lightning.engines import TorchEngine

    audit = tmp_path / "audit.jsonl"

    def fit(steps: int, ckpt: str | None = None) -> None:
        tasks = Tasks([Source(path=str(jsonl), prompt="question", verifier="last_number")])
        module = AsyncRLModule(agent=Answer(max_tokens=8), tasks=tasks, policy=policy_path,
                               engine=TorchEngine(seed=0), rollout=Rollout(group_size=2, prompts_per_step=4,
                                                                           max_lag=0))
        trainer = L.Trainer(max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[SampleAudit(str(audit)), ModelCheckpoint(
                                dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)])
        trainer.fit(module, ckpt_path=ckpt)

    fit(2)
    fit(5, ckpt=str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt"))
    steps = replay([json.loads(x) for x in audit.read_text().splitlines()])
    trained = [i for s in steps for i in s["samples"]]
    assert sorted(trained) == list(range(20))  # 5 steps x 4 prompts: none repeated, none skipped
    tasks = Tasks([Source(path=str(jsonl), prompt="question", verifier="last_number")])
    epoch0 = [s["row"] for s in tasks(0)]
    assert sorted(epoch0[i] for i in trained if i < 12) == list(range(12))  # epoch 0: every row once
    assert len([i for i in trained if i >= 12]) == 8  # then 8 prompts of epoch 1


# ----- bad data: the file, the row and the field, before anything starts -----
@pytest.mark.parametrize("rows, source, message", [
    ([{"question": "q", "answer": 1}, {"text": "q2", "answer": 2}], {"prompt": "question"},
     r"row 1: no field 'question' \(the row has \['answer', 'text'\]\)"),
    ([{"question": "q", "answer": 1}, {"question": "  ", "answer": 2}], {"prompt": "question"},
     r"row 1: the prompt is empty"),
    ([{"question": "q", "answer": 1}, {"question": "q2"}], {"prompt": "question"},
     r"row 1: no answer in field 'answer'"),
    ([{"q": "x", "answer": 1}], {"template": "Solve {question}"},
     r"row 0: the template names the field 'question', which the row lacks"),
    ([{"question": "q", "answer": 1, "tools": {"a": 1}}], {"prompt": "question", "tools": "tools"},
     r"row 0: field 'tools' must be a list of tool schemas"),
    ([{"question": "q", "answer": 1}], {"prompt": "question", "verifier": "regex:("},
     r"verifier 'regex:\(': the pattern does not compile"),
    ([{"question": "q", "answer": 1}], {"prompt": "question", "verifier": "nope.nothing.here"},
     r"verifier 'nope.nothing.here' is not one of"),
])
def test_bad_rows_are_named(tmp_path, rows, source, message):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError, match=f"{path}.*{message}" if "verifier" not in source else message):
        Tasks([Source(path=str(path), **source)])


def test_unreadable_files_are_named(tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "q", "answer": 1}\n{"question": "q2", answer: 2}\n')
    with pytest.raises(ValueError, match=r"broken.jsonl: line 2 is not valid JSON"):
        Tasks([Source(path=str(broken))])
    with pytest.raises(ValueError, match=r"missing.jsonl: no such file or folder"):
        Tasks([Source(path=str(tmp_path / "missing.jsonl"))])
    (tmp_path / "data.xlsx").write_text("x")
    with pytest.raises(ValueError, match=r"data.xlsx: unknown file type"):
        Tasks([Source(path=str(tmp_path / "data.xlsx"))])
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match=r"junk.parquet could not be read"):
        Tasks([Source(path=str(junk))])
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"empty.jsonl"):
        Tasks([Source(path=str(tmp_path / "empty.jsonl"))])


def test_source_settings_are_checked():
    with pytest.raises(ValueError, match="exactly one of path, reasoning_gym or generator"):
        Source()
    with pytest.raises(ValueError, match="prompt .* or template, not both"):
        Source(path="x.jsonl", prompt="q", template="{q}")
    with pytest.raises(ValueError, match="distinct names"):
        Tasks([Source(generator="data_helpers.rows")] * 2)
    with pytest.raises(ValueError, match="unknown task|chain_summ"):
        Tasks([Source(reasoning_gym="chain_summ")])


def test_molt_fit_answers_bad_data_before_anything_starts(tmp_path, capsys):
    """Through the CLI: the recipe's data is read when the recipe is, and a bad row is the error line (no traceback,
    no engine started)."""
    import yaml
    from test_bad_inputs import answer

    path = write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "answer": 1}, {"text": "x", "answer": 2}])
    recipe = {"trainer": {"accelerator": "cpu", "max_steps": 1, "logger": False},
              "model": {"agent": {"class_path": "molt_lightning.agents.Answer"},
                        "tasks": {"class_path": "molt_lightning.data.Tasks",
                                  "init_args": {"sources": [{"path": str(path), "prompt": "question"}]}},
                        "engine": {"class_path": "molt_lightning.engines.TorchEngine"}}}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    err = answer(capsys, "--config", str(tmp_path / "r.yaml"))  # exit code 2, no traceback
    assert f"error: data source {path}, row 1: no field 'question'" in err
