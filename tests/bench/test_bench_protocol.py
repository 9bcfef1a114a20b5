"""Protocols: loading, fingerprints, overrides, and compare's refusal of mismatched runs."""

from __future__ import annotations

import copy

import pytest
import yaml

from molt_lightning.bench import compare
from molt_lightning.bench.protocol import (
    PROTOCOL_DIR,
    Protocol,
    ProtocolError,
    check_matched,
    diff,
    fingerprint,
    load_protocol,
)


def test_shipped_protocols_load_and_have_distinct_fingerprints():
    paths = sorted(PROTOCOL_DIR.glob("*.yaml"))
    assert len(paths) >= 2
    prints = {load_protocol(p).fingerprint for p in paths}
    assert len(prints) == len(paths)
    tiny = load_protocol("arithmetic-tiny")
    assert tiny.samples_per_step == 64 and tiny.metrics["step_time_s"].margin_rel == pytest.approx(0.10)


def test_fingerprint_ignores_names_and_key_order_but_not_matched_fields(smoke_protocol):
    p = smoke_protocol
    reordered = dict(reversed(list(copy.deepcopy(p).items())))
    renamed = {**copy.deepcopy(p), "name": "other", "description": "text"}
    assert fingerprint(Protocol(reordered).matched()) == Protocol(p).fingerprint == Protocol(renamed).fingerprint
    for dotted, value in [("max_lag", 2), ("optimizer.lr", 3e-4), ("batch.samples_per_prompt", 16),
                          ("metrics.reward.margin", 0.1), ("seeds", [0, 1])]:
        changed = Protocol(p).with_changes({dotted: value})
        assert changed.fingerprint != Protocol(p).fingerprint, dotted


def test_overrides_parse_yaml_values(tmp_path, smoke_protocol):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(smoke_protocol))
    p = load_protocol(path, ["steps=7", "optimizer.lr=3e-4", "optimizer.betas=[0.8, 0.9]"])
    assert p.data["steps"] == 7 and p.data["optimizer"]["lr"] == 3e-4 and p.data["optimizer"]["betas"] == [0.8, 0.9]
    with pytest.raises(ProtocolError, match="key.path=value"):
        load_protocol(path, ["steps"])
    with pytest.raises(ProtocolError, match="not a section"):
        load_protocol(path, ["nosuch.field=1"])


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d.pop("optimizer"), r"lacks \['optimizer'\]"),
    (lambda d: d["metrics"]["reward"].update(goal="up"), "goal must be max or min"),
    (lambda d: d["metrics"]["reward"].update(margin="ten"), "neither a number nor a percentage"),
    (lambda d: d.update(seeds=[]), "seeds must be a non-empty list"),
])
def test_malformed_protocols_are_refused_with_the_reason(smoke_protocol, mutate, match):
    data = copy.deepcopy(smoke_protocol)
    mutate(data)
    with pytest.raises(ProtocolError, match=match):
        Protocol(data)


def test_unknown_protocol_name_lists_the_known_ones():
    with pytest.raises(ProtocolError, match="arithmetic-tiny"):
        load_protocol("no-such-protocol")


def test_seed_selection(smoke_protocol):
    p = Protocol(smoke_protocol)
    assert p.seeds(2) == [0, 1]
    with pytest.raises(ProtocolError, match="lists 4 seeds"):
        p.seeds(9)


def test_diff_and_allow_prefixes(smoke_protocol):
    a = Protocol(smoke_protocol)
    b = a.with_changes({"max_lag": 0, "optimizer.lr": 0.5, "optimizer.weight_decay": 0.1})
    assert [k for k, _, _ in diff(a.data, b.data)] == ["max_lag", "optimizer.lr", "optimizer.weight_decay"]
    assert len(check_matched(a.data, b.data, ["max_lag", "optimizer"])) == 3
    with pytest.raises(ProtocolError) as err:
        check_matched(a.data, b.data, ["max_lag"])
    message = str(err.value)
    assert "optimizer.lr: A=0.001  B=0.5" in message and "--allow-diff optimizer.lr" in message
    assert "max_lag" not in message.split("differ:")[1]


def test_compare_refuses_runs_of_different_protocols(tmp_path, smoke_protocol, make_runset):
    other = Protocol(smoke_protocol).with_changes({"max_lag": 0, "sampling.temperature": 0.7}).data
    a = make_runset(tmp_path, "a", [0.5, 0.6, 0.55], smoke_protocol)
    b = make_runset(tmp_path, "b", [0.5, 0.6, 0.55], other)
    with pytest.raises(ProtocolError) as err:
        compare.compare_runsets(a, b, ["reward"])
    message = str(err.value)
    assert "different protocols" in message
    assert "max_lag: A=1  B=0" in message and "sampling.temperature: A=1.0  B=0.7" in message
    assert "--allow-diff max_lag --allow-diff sampling.temperature" in message
    _, _, allowed, results = compare.compare_runsets(a, b, ["reward"], allow=["max_lag", "sampling"])
    assert len(allowed) == 2 and results[0].result.verdict_kind in {"comparable", "inconclusive"}


def test_cli_prints_the_mismatch_and_exits_2(tmp_path, smoke_protocol, capsys, make_runset):
    from molt_lightning.bench.cli import main

    a = make_runset(tmp_path, "a", [0.5, 0.6], smoke_protocol)
    b = make_runset(tmp_path, "b", [0.5, 0.6], Protocol(smoke_protocol).with_changes({"steps": 9}).data)
    assert main(["compare", str(a), str(b), "--no-report"]) == 2
    err = capsys.readouterr().err
    assert "steps: A=3  B=9" in err and "--allow-diff steps" in err
