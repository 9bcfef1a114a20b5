"""Token selection (``algorithms.selection``) by hand-derived numbers: the top-entropy share over the whole batch,
overlong filtering by the truncation cause, the denominator rule (a removed token leaves the norms, a loss-side weight
keeps them); and the step record the step hands the callbacks (``trainer.record``), with ``UpdateKL`` on it."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from molt_lightning.algorithms import Algorithm, LossInputs, SelectionInputs, build, objective
from molt_lightning.algorithms.objective import Norm
from molt_lightning.algorithms.selection import chained, overlong_filter, top_entropy
from molt_lightning.callbacks import UpdateKL
from molt_lightning.engines import TorchEngine
from molt_lightning.trainer.plan import plan, selected

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
sys.path.insert(0, str(Path(__file__).parent))
from modules import make_module  # noqa: E402
from test_loop import fit  # noqa: E402
from test_step import synthetic_batch  # noqa: E402

MASK = torch.tensor([[True, True, True, False], [True, True, True, False]])  # (2, 4): six policy tokens
ENTROPY = torch.tensor([[0.1, 0.4, 0.2, 9.0], [0.9, 0.5, 0.3, 9.0]])  # 9.0: off the mask, never counted


def test_top_entropy_keeps_the_share_with_the_highest_entropy_over_the_whole_batch():
    # the six entropies sorted: 0.1 0.2 0.3 0.4 0.5 0.9; the 0.5 quantile (linear): 0.3 + 0.5 * (0.4 - 0.3) = 0.35
    kept = top_entropy(SelectionInputs(MASK, ENTROPY, ["", ""]), Algorithm(top_entropy_share=0.5))
    assert kept.tolist() == [[False, True, False, False], [True, True, False, False]]  # 0.4, 0.9, 0.5
    # share 0.2: the 0.8 quantile = 0.4 + 0.5 * (0.5 - 0.4) = 0.45 -> 0.9 and 0.5
    kept = top_entropy(SelectionInputs(MASK, ENTROPY, ["", ""]), Algorithm(top_entropy_share=0.2))
    assert kept.tolist() == [[False, False, False, False], [True, True, False, False]]
    # row 0 alone (one micro-batch, or one rank's rows) would keep its own top half: the batch-wide one keeps 0.4 only
    alone = top_entropy(SelectionInputs(MASK[:1], ENTROPY[:1], [""]), Algorithm(top_entropy_share=0.5))
    assert alone.tolist() == [[False, True, True, False]]


def test_overlong_filter_drops_the_rows_cut_at_max_tokens_only():
    causes = ["max_tokens", "max_turns"]
    kept = overlong_filter(SelectionInputs(MASK, None, causes), Algorithm())
    assert kept.tolist() == [[False] * 4, [True, True, True, False]]


def test_selections_chain_and_never_add_tokens():
    select = chained(["overlong_filter", "top_entropy"])
    assert select.needs_entropy and not chained(["overlong_filter"]).needs_entropy
    kept = select(SelectionInputs(MASK, ENTROPY, ["max_tokens", ""]), Algorithm(top_entropy_share=0.5))
    # row 0 gone; among row 1's 0.9 0.5 0.3 the 0.5 quantile is 0.5: 0.9 and 0.5 stay
    assert kept.tolist() == [[False] * 4, [True, True, False, False]]
    with pytest.raises(ValueError, match="unknown token_selection 'nope'"):
        build(Algorithm(token_selection="nope"))


def test_a_removed_token_leaves_the_denominators_a_weight_keeps_them():
    """token_mean over 6 tokens of per-token loss -A*r (pg at ratio 1): advantages 1..6. Selecting the top half by
    entropy (0.4, 0.9, 0.5: advantages 2, 4, 5) divides by 3, not 6: -(2 + 4 + 5) / 3. An IS weight of 0 on the same
    three others keeps all 6 in the denominator: -(2 + 4 + 5) / 6."""
    cfg = Algorithm(loss="pg", is_mode="none", token_selection="top_entropy", top_entropy_share=0.5)
    adv = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 5.0, 6.0, 0.0]])
    logprobs = torch.zeros(2, 4)
    kept = build(cfg).select(SelectionInputs(MASK, ENTROPY, ["", ""]), cfg)
    loss_fn = build(cfg).loss

    def loss(mask, weight=None):
        inp = LossInputs(logprobs=logprobs, old_logprobs=logprobs, advantages=adv, mask=mask, is_weight=weight)
        return float(objective(inp, loss_fn, cfg, Norm.of(mask))[0])

    assert loss(kept) == pytest.approx(-(2 + 4 + 5) / 3)
    assert loss(MASK, weight=kept.float()) == pytest.approx(-(2 + 4 + 5) / 6)


def test_the_plan_counts_the_tokens_a_selection_kept():
    batch = synthetic_batch(groups=4, group_size=3)
    rows = len(batch.traj_ids)
    entropy = torch.arange(batch.loss_mask[:, 1:].numel(), dtype=torch.float32).reshape(rows, -1)  # distinct values
    cfg = Algorithm(token_selection="top_entropy", top_entropy_share=0.25)
    after, metrics = selected(batch, build(cfg).select, entropy, cfg)
    before, kept = int(batch.loss_mask.sum()), int(after.loss_mask.sum())
    assert kept == pytest.approx(before * 0.25, abs=1) and metrics["select/kept_frac"] == kept / before
    norms = [mb.norm for rank in range(2) for mb in plan(after, 2, rank, 1, 40)]
    assert {n.tokens for n in norms} == {float(kept)}  # every rank's micro-batches divide by the batch's kept count
    assert norms[0].rows == float(after.loss_mask.any(-1).sum())
    assert metrics["select/samples_dropped"] == int(batch.loss_mask.any(-1).sum() - after.loss_mask.any(-1).sum())


def test_overlong_filtering_reads_each_rows_truncation_cause():
    from molt_lightning.trajectory import Truncation, collate

    trajs = synthetic_batch(groups=2, group_size=3).trajectories
    trajs[0].truncate(Truncation.MAX_TOKENS, "a turn hit max_tokens=7")
    trajs[4].truncate(Truncation.MAX_TURNS, "the environment was not done after max_turns=3")
    batch = collate(trajs, pad_id=0, max_version=0)
    cfg = Algorithm(token_selection="overlong_filter")
    after, metrics = selected(batch, build(cfg).select, None, cfg)
    cut = [batch.trajectories[i] is trajs[0] for i in batch.traj_ids.tolist()]  # the rows of the one cut at max_tokens
    for row, dropped in enumerate(cut):
        assert torch.equal(after.loss_mask[row], batch.loss_mask[row] & ~torch.tensor(dropped)), row
    assert metrics["select/samples_dropped"] == sum(cut) >= 1


# ----- the step record -----

class Records(L.Callback):
    def __init__(self):
        self.records = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.records.append(outputs["record"])


@pytest.mark.slow
@pytest.mark.parametrize("updates", [1, 2])
def test_the_step_hands_out_what_it_computed(tmp_path, updates):
    """At max_lag 0 on the torch engine the trainer's logprobs before the update are the engine's (the IS weight 1);
    the record covers this rank's rows; with two optimizer steps its logprobs are PPO's old ones, still before the
    update; UpdateKL is 0 when nothing moved (lr 0) and > 0 when the policy did."""
    for lr, moved in ((0.0, False), (3e-3, True)):
        got = Records()
        module = make_module(engine=TorchEngine(seed=0), group_size=4, prompts_per_step=4, max_lag=0, lr=lr,
                             updates_per_batch=updates, micro_batch_tokens=256)
        _, df = fit(module, tmp_path / f"{lr}", 2 * updates, [got, UpdateKL()])  # max_steps: optimizer steps
        for record in got.records:
            mask = record.loss_mask
            assert record.rows == sorted(range(len(record.batch.traj_ids)))
            assert torch.equal(mask, record.policy_mask)  # no selection: every policy token trained
            assert torch.allclose(record.logprobs[mask], record.engine_logprobs[mask], atol=1e-4)
            assert torch.allclose(record.is_weight[mask], torch.ones(int(mask.sum())), atol=1e-3)
            assert (record.entropy[mask] > 0).all() and not record.advantages.requires_grad
        kl = df["update/kl"].dropna()
        assert len(got.records) == len(kl) == 2, kl.tolist()
        assert (kl.abs() < 1e-6).all() if not moved else (kl > 1e-5).all(), kl.tolist()


@pytest.mark.slow
def test_a_selection_from_the_recipe_reaches_the_step_and_its_metrics(tmp_path):
    got = Records()
    module = make_module(engine=TorchEngine(seed=0), group_size=4, prompts_per_step=4, max_lag=0,
                         micro_batch_tokens=128, algo=Algorithm(token_selection="top_entropy", top_entropy_share=0.2))
    _, df = fit(module, tmp_path, 2, [got])
    for record in got.records:
        share = float(record.loss_mask.sum() / record.policy_mask.sum())
        assert share == pytest.approx(0.2, abs=0.05)
        kept = record.entropy[record.loss_mask].min()  # the loss pass's entropies: the policy before the update
        assert (record.entropy[record.policy_mask & ~record.loss_mask] <= kept + 1e-4).all()
    assert df["select/kept_frac"].dropna().between(0.15, 0.25).all()
