"""The algorithm pieces inside the loop (torch engine): every recipe in recipes/algorithms (an overlay on
recipes/default.yaml holding only what differs) runs its algorithm as stacked on the default; the critic, the
reference policy and dynamic sampling are wired as their algorithms need."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import io
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import yaml
from test_loop import Batches
from test_loop import fit as fit_loop
from test_loop import make as make_loop

from molt_lightning.rollout import source as rollout
from molt_lightning.algorithms import GROUP_FILTERS, Algorithm
from molt_lightning.engines import TorchEngine
from molt_lightning.commands.cli import main
from molt_lightning.trainer.policy import logprobs_and_entropy

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes" / "algorithms").glob("*.yaml"))
DEFAULT = "recipes/default.yaml"


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@functools.cache
def _stacked(*configs: str) -> str:
    out = io.StringIO()
    with contextlib.chdir(ROOT), mock.patch.object(sys, "argv", ["molt"]), contextlib.redirect_stdout(out), \
            pytest.raises(SystemExit) as e:
        main(["fit", *(a for c in configs for a in ("--config", c)), "--print_config"])
    assert e.value.code in (0, None)
    return out.getvalue()


def stacked(*configs: str) -> dict:
    """The configuration ``molt fit --config C1 --config C2 ...`` runs (its --print_config), from the repo's root."""
    return yaml.safe_load(_stacked(*configs))


def fit(module, tmp_path, steps, callbacks=()):
    """test_loop's ``fit``, returning only the logged metrics."""
    return fit_loop(module, tmp_path, steps, callbacks)[1]


def make(algo: Algorithm, **kw):
    return make_loop(TorchEngine(seed=0), **{"prompts_per_step": 2, "algo": algo, **kw})


def recipe_algo(path: Path) -> Algorithm:
    """The algorithm of the overlay stacked on the default, as `molt fit` runs it."""
    return Algorithm(**stacked(DEFAULT, rel(path))["model"]["algo"])


def recipe_rollout(path: Path) -> dict:
    """The recipe's group size (one-sample algorithms), at the test's size of 2 prompts a step."""
    return {"group_size": 1, "prompts_per_step": 8} if stacked(DEFAULT, rel(path))["model"]["rollout"][
        "group_size"] == 1 else {}


def test_every_family_has_a_recipe():
    names = {p.stem for p in RECIPES}
    assert {"grpo", "dr_grpo", "dapo", "gspo", "cispo", "rloo", "reinforce", "reinforce_pp", "ppo", "flash_reinforce",
            "turn_grpo", "length_penalties"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_algorithm_trains(recipe, tmp_path, policy_path):
    from transformers import AutoModelForCausalLM

    module = make(recipe_algo(recipe), **recipe_rollout(recipe))
    df = fit(module, tmp_path, steps=2)
    losses = torch.tensor(df["loss/total"].dropna().tolist())
    assert losses.numel() == 2 and torch.isfinite(losses).all()
    for name in ["loss/policy", "entropy", "is/ratio_mean", "is/masked_frac", "mismatch/kl", "reward/shaped"]:
        assert df[name].notna().any(), name
    before = AutoModelForCausalLM.from_pretrained(policy_path).state_dict()
    assert any(not torch.equal(before[k], v) for k, v in module.policy.lm.state_dict().items())


@pytest.mark.slow
def test_ppo_value_head_shares_the_trunk_trains_and_stays_out_of_the_engine(tmp_path):
    module = make(Algorithm(advantage="gae", lam=0.95))
    pushed = []
    original = module.engine.stage_weights

    async def stage_weights(bucket):
        pushed.append(set(bucket))
        await original(bucket)

    module.engine.stage_weights = stage_weights
    df = fit(module, tmp_path, steps=3)
    head = module.policy.value_head
    assert head is not None and head.weight.abs().sum() > 0  # zero-initialized, then trained
    opt_params = {id(p) for g in module.optimizers().optimizer.param_groups for p in g["params"]}
    assert id(head.weight) in opt_params and id(head.bias) in opt_params
    assert all(not any(k.startswith("value_head") for k in keys) for keys in pushed)
    assert df["loss/value"].dropna().size == 3 and df["value/mean"].dropna().abs().sum() > 0
    assert "policy.value_head.weight" in module.state_dict()  # checkpointed with the module


def test_kl_reference_is_frozen_and_kl_starts_at_zero(tmp_path):
    module = make(Algorithm(kl_coef=0.05, kl_estimator="k3"), max_lag=0)
    df = fit(module, tmp_path, steps=3)
    ref, pol = module.reference.state_dict(), module.policy.state_dict()
    assert not any(p.requires_grad for p in module.reference.parameters())
    assert any(not torch.equal(ref[k], pol[k]) for k in ref)  # the policy moved, the reference did not
    kl = df["kl/ref"].dropna().tolist()
    assert kl[0] == pytest.approx(0.0, abs=1e-7) and kl[-1] > 0  # policy == reference before the first update
    opt_params = {id(p) for g in module.optimizers().optimizer.param_groups for p in g["params"]}
    assert not any(id(p) in opt_params for p in module.reference.parameters())


@pytest.mark.slow
def test_dynamic_sampling_drops_zero_variance_groups_counts_them_and_refills(tmp_path):
    batches = Batches()
    module = make(Algorithm(group_filter="nonzero_std"))
    df = fit(module, tmp_path, steps=3, callbacks=[batches])
    counts = module.source.counts
    assert counts.dropped_filtered_groups > 0  # the warm start answers ~15% right: most groups of 4 are all 0
    assert counts.dropped_filtered_samples == 4 * counts.dropped_filtered_groups
    for _, b in batches.seen:  # (policy version, batch)
        groups = {}
        for t in b.trajectories:
            groups.setdefault(t.group_id, []).append(t.reward)
        assert len(groups) == 2  # refilled: always prompts_per_step groups
        assert all(max(r) > min(r) for r in groups.values())
    assert (df["adv/abs_mean"].dropna() > 0).all()


def reject_all(rewards):
    return False


def test_dynamic_sampling_gives_up_loudly(tmp_path, monkeypatch):
    monkeypatch.setattr(rollout, "FILTER_PATIENCE", 1)
    monkeypatch.setitem(GROUP_FILTERS, "reject_all", reject_all)
    module = make(Algorithm(group_filter="reject_all"))
    with pytest.raises(RuntimeError, match="the rollout producer died"):
        fit(module, tmp_path, steps=1)
    assert module.source.counts.dropped_filtered_groups >= 2


@pytest.mark.parametrize("form", ["decoupled", "bypass"])
def test_on_policy_is_ratio_is_one_in_both_forms(form, tmp_path):
    algo = Algorithm(is_form=form, is_mode="truncate" if form == "decoupled" else "none")
    df = fit(make(algo, max_lag=0), tmp_path, steps=2)
    assert ((df["is/ratio_min"].dropna() - 1).abs() < 1e-3).all()
    assert ((df["is/ratio_max"].dropna() - 1).abs() < 1e-3).all()
    assert (df["loss/clip_frac"].dropna() == 0).all()


def test_logprobs_and_entropy_by_hand():
    # vocabulary of 2 with probabilities 1/4, 3/4 at temperature 2 (logits 0, 2 ln 3):
    # entropy = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.562335; the next token (id 1) has logprob ln 3/4
    logits = torch.tensor([[[0.0, 2 * torch.log(torch.tensor(3.0))], [5.0, 5.0]]])  # (1, 2, V=2)
    logprobs, entropy = logprobs_and_entropy(logits, torch.tensor([[0, 1]]), temperature=2.0, entropy_grad=False)
    assert logprobs.item() == pytest.approx(torch.log(torch.tensor(0.75)).item(), rel=1e-6)
    assert entropy.item() == pytest.approx(0.562335, rel=1e-5)


def test_filtered_groups_are_counted_with_their_reward():
    from molt_lightning.config import Rollout
    from molt_lightning.rollout import RolloutSource
    from molt_lightning.trajectory import Trajectory

    source = RolloutSource(None, None, Rollout(group_size=2), group_filter=GROUP_FILTERS["nonzero_std"])
    source._reject(0, [Trajectory(0, 0, reward=1.0), Trajectory(0, 0, reward=1.0)])
    source._reject(1, [Trajectory(1, 1, reward=-0.5), Trajectory(1, 1, reward=-0.5)])
    counts = source.counts_now()
    assert counts.dropped_filtered_groups == 2 and counts.dropped_filtered_samples == 4
    assert counts.filtered_reward_sum == pytest.approx(2 * 1.0 + 2 * -0.5)
    assert source.admission.next_prompt == 2  # both prompts are done (not retried); their slots are free for new ones


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_an_algorithm_recipe_is_an_overlay_of_only_what_differs(recipe):
    """Each family recipe is an overlay on recipes/default.yaml (its first line the command that stacks them:
    tests/test_recipes.py parses it) that holds its log name (runs/NAME), its algorithm and, for a one-sample
    algorithm (FlashREINFORCE), the default's 64 samples a step as 64 groups of one: nothing the default already says,
    so the recipes cannot drift from it."""
    text = recipe.read_text()
    assert text.startswith(f"# Overlay on {DEFAULT}: `molt fit --config {DEFAULT} --config {rel(recipe)}`")
    default, this = yaml.safe_load((ROOT / DEFAULT).read_text()), yaml.safe_load(text)
    assert set(this) == {"trainer", "model"} and set(this["model"]) <= {"algo", "rollout"}, set(this)
    assert this["trainer"] == {"logger": {"init_args": {"name": recipe.stem}}}
    assert this["model"]["algo"] != default["model"]["algo"]
    if rollout := this["model"].get("rollout"):
        assert rollout == {"group_size": 1, "prompts_per_step": default["model"]["rollout"]["group_size"] *
                           default["model"]["rollout"]["prompts_per_step"]}


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_an_algorithm_overlay_stacked_on_the_default_is_the_default_with_its_differences(recipe):
    """Stacked (`molt fit --config recipes/default.yaml --config recipes/algorithms/X.yaml`), the run is the
    default's in all but the overlay's keys, and its algorithm is the overlay's ``model.algo`` over Algorithm's
    defaults: nothing of the default recipe's ``algo`` leaks in (its ``scale_by_std: false``; nested keys merge key
    by key, so each overlay says ``scale_by_std: true``). Each stacked configuration was checked equal, key for key, to
    the one of the full copy each recipe was before it became an overlay."""
    this = yaml.safe_load(recipe.read_text())
    expected = copy.deepcopy(stacked(DEFAULT))
    expected["trainer"]["logger"]["init_args"]["name"] = recipe.stem
    expected["model"]["rollout"].update(this["model"].get("rollout", {}))
    expected["model"]["algo"] = dataclasses.asdict(Algorithm(**this["model"]["algo"]))
    assert stacked(DEFAULT, rel(recipe)) == expected


def test_turn_credit_tags_each_token_with_its_turn_and_the_agents_turn_rewards(tmp_path):
    """The two-question agent: every trained row holds turn 0's tokens, then turn 1's (each the engine call that made
    them), and the batch's per-turn rewards are the agent's [score, 0]."""
    from molt_lightning.tasks import arithmetic

    batches = Batches()
    module = make(Algorithm(advantage="turn_grpo"), agent=arithmetic.two_question_agent, max_lag=0)
    df = fit(module, tmp_path, steps=2, callbacks=[batches])
    assert torch.isfinite(torch.tensor(df["loss/total"].dropna().tolist())).all()
    for _, b in batches.seen:
        for row in range(b.input_ids.shape[0]):
            turns = b.turns[row][b.loss_mask[row]].tolist()
            assert turns == sorted(turns) and set(turns) == {0, 1}
            spans = [s for s in b.trajectories[int(b.traj_ids[row])].policy_spans()]
            assert [s.turn for s in spans] == [0, 1] and turns.count(0) == len(spans[0].token_ids)
        out = b.outcomes
        assert torch.equal(out.turn_rewards[:, 0], out.rewards) and (out.turn_rewards[:, 1] == 0).all()


def test_distillation_from_the_policy_itself_starts_at_zero_reverse_kl(tmp_path, policy_path):
    """Teacher = the initial policy: the teacher's logprobs of the sampled tokens equal the engine's (max_lag 0), so
    the reverse KL estimate is ~0 before the first update (a shifted or misaligned teacher would not be), and grows
    once the student moves; the teacher stays frozen and out of the optimizer."""
    module = make(Algorithm(advantage="none", distill_coef=1.0, loss="pg"), teacher=policy_path, max_lag=0, lr=1e-2)
    df = fit(module, tmp_path, steps=3)
    kl = df["distill/reverse_kl"].dropna().tolist()
    assert abs(kl[0]) < 1e-3 and abs(kl[-1]) > 10 * abs(kl[0])
    opt_params = {id(p) for g in module.optimizers().optimizer.param_groups for p in g["params"]}
    assert not any(id(p) in opt_params or p.requires_grad for p in module.teacher.parameters())


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path):
    from molt_lightning.models.tiny import python_tool_policy

    module = make(Algorithm(distill_coef=1.0), teacher=python_tool_policy())
    with pytest.raises(ValueError, match="another tokenizer than the policy"):
        fit(module, tmp_path, steps=1)


def test_gigpo_trains_on_an_environment_whose_turns_share_states(tmp_path):
    """GiGPO on the calculator environment (EnvAgent: the observation each reply answered is its state key): the
    question is every run's first state, so each group's first turns form one step group."""
    from molt_lightning.agents.env import EnvAgent
    from molt_lightning.tasks.arithmetic_env import CalculatorEnv

    batches = Batches()
    module = make(Algorithm(advantage="gigpo", turn_gamma=0.95), agent=EnvAgent(CalculatorEnv, max_turns=3,
                                                                                  max_tokens=16))
    df = fit(module, tmp_path, steps=2, callbacks=[batches])
    assert torch.isfinite(torch.tensor(df["loss/total"].dropna().tolist())).all()
    for _, b in batches.seen:
        keys, groups = b.outcomes.turn_keys, b.outcomes.groups
        for g in groups.unique():
            assert len(set(keys[groups == g, 0].tolist())) == 1  # one question per group: one first state


def route_choice_kl(student, teacher, tokenizer, n: int = 64) -> float:
    """Exact KL(student || teacher) over the vocabulary at the first reply token (tool or answer: where the two
    differ most) of ``n`` fixed calculator dialogues, half of them on the tool route."""
    import random

    from molt_lightning.agents.chat import ChatTemplate
    from molt_lightning.tasks import arithmetic
    from molt_lightning.trainer.sft import collate, render

    rng, template = random.Random(7), ChatTemplate(tokenizer)
    ids, labels, attention = collate([render(template, arithmetic.demonstration(rng, p_tool=0.5), None)
                                      for _ in range(n)], tokenizer.pad_token_id)
    first = (labels[:, 1:] != -100).long().cumsum(-1) == 1  # (B, T-1): at most one position per dialogue
    first &= labels[:, 1:] != -100
    with torch.no_grad():
        s, t = (torch.log_softmax(m(input_ids=ids, attention_mask=attention).logits[:, :-1].float(), -1)[first]
                for m in (student, teacher))
    return float((s.exp() * (s - t)).sum(-1).mean())


@pytest.mark.slow
def test_distillation_from_a_stronger_teacher_closes_the_reverse_kl(tmp_path, tokenizer, policy_path):
    """The shipped tiny teacher (the student's network, warm-started to take the tool route 90% of the time, the
    student 15%): distillation alone (no reward in the advantage) shrinks KL(student || teacher) where they differ,
    at the route choice (measured exactly on fixed dialogues: the logged estimate, on a step's 8 samples, is too noisy
    to show a trend in 10 steps: seeds 0-5 gave a first step of 0.01-0.28)."""
    from transformers import AutoModelForCausalLM

    from molt_lightning.models.tiny import teacher_policy

    module = make(Algorithm(advantage="none", distill_coef=1.0), teacher=teacher_policy(), lr=1e-3)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_policy()).eval()
    before = route_choice_kl(AutoModelForCausalLM.from_pretrained(policy_path).eval(), teacher, tokenizer)
    kl = fit(module, tmp_path, steps=10)["distill/reverse_kl"].dropna()
    after = route_choice_kl(module.policy.lm.eval(), teacher, tokenizer)
    assert len(kl) == 10 and kl.abs().max() < 5  # logged every step
    # 1.55 -> 0.013-0.048 over seeds 0-5 (the engine's and the tasks')
    assert before > 1.0 and after < 0.25 * before, (before, after)
