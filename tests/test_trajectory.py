"""The batch builder enforces the consistency invariant: no trained token without an engine record."""

import math

import pytest
import torch

from molt_lightning.trajectory import ConsistencyError, Kind, Span, Status, Trajectory, collate, repeats

PAD = 0


def traj(segments, reward=1.0, group=0, sample=0):
    return Trajectory(sample_id=sample, group_id=group, segments=segments, reward=reward)


def test_collate_places_every_field_at_its_token():
    t0 = traj([[Span.context(Kind.PROMPT, [5, 6]), Span.policy([7, 8], [-0.1, -0.2], [3, 3]),
                Span.context(Kind.ENV, [9]), Span.policy([10], [-0.3], [4])]], reward=0.5, group=2)
    t1 = traj([[Span.context(Kind.PROMPT, [11]), Span.policy([12], [-0.4], [4])],
               [Span.context(Kind.PROMPT, [13, 14]), Span.policy([15], [-0.5], [4])]], reward=1.0, group=2, sample=1)
    b = collate([t0, t1], PAD, max_version=4)
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9, 10], [11, 12, PAD, PAD, PAD, PAD], [13, 14, 15, PAD, PAD, PAD]]
    assert b.loss_mask.tolist() == [[False, False, True, True, False, True], [False, True] + [False] * 4,
                                    [False, False, True] + [False] * 3]
    assert b.attention_mask.sum(1).tolist() == [6, 2, 3]
    assert torch.allclose(b.engine_logprobs[0], torch.tensor([0, 0, -0.1, -0.2, 0, -0.3]))
    assert b.versions[0].tolist() == [-1, -1, 3, 3, -1, 4]
    assert b.traj_ids.tolist() == [0, 1, 1]
    # per trajectory, once: reward, policy tokens over all of its segments, group
    assert b.outcomes.rewards.tolist() == [0.5, 1.0] and b.outcomes.lengths.tolist() == [3, 2]
    assert b.outcomes.groups.tolist() == [2, 2]
    assert b.group_ids.tolist() == [2, 2, 2]


def test_policy_tokens_without_engine_record_raise():
    with pytest.raises(ConsistencyError, match="engine record"):
        collate([traj([[Span.context(Kind.PROMPT, [1]), Span(Kind.POLICY, [2, 3])]])], PAD)
    with pytest.raises(ConsistencyError, match="engine record"):  # one logprob short
        collate([traj([[Span.context(Kind.PROMPT, [1]), Span(Kind.POLICY, [2, 3], [-0.1], [0, 0])]])], PAD)
    with pytest.raises(ConsistencyError, match="Span.policy"):
        Span.context(Kind.POLICY, [1])


def test_impossible_versions_and_logprobs_raise():
    ok_prompt = Span.context(Kind.PROMPT, [1])
    with pytest.raises(ConsistencyError, match="outside"):
        collate([traj([[ok_prompt, Span.policy([2], [-0.1], [5])]])], PAD, max_version=4)
    stale = [traj([[ok_prompt, Span.policy([2, 3], [-0.1, -0.2], [1, 2])]])]  # the staleness bound, where batches form
    assert collate(stale, PAD, max_version=3, max_lag=2).versions.max() == 2
    with pytest.raises(ConsistencyError, match=r"outside \[2, trainer 3\] \(max_lag 1\)"):
        collate(stale, PAD, max_version=3, max_lag=1)
    with pytest.raises(ConsistencyError, match="finite"):
        collate([traj([[ok_prompt, Span.policy([2], [math.nan], [0])]])], PAD)
    with pytest.raises(ConsistencyError, match="starts with a policy token"):
        collate([traj([[Span.policy([2], [-0.1], [0])]])], PAD)


def test_failed_or_nan_reward_trajectories_never_reach_a_batch():
    good = [[Span.context(Kind.PROMPT, [1]), Span.policy([2], [-0.1], [0])]]
    with pytest.raises(ConsistencyError, match="failed"):
        collate([traj(good).fail("agent raised")], PAD)
    with pytest.raises(ConsistencyError, match="non-finite reward"):
        collate([traj(good, reward=math.nan)], PAD)


def test_segments_without_generated_tokens_are_skipped_and_empty_batches_raise():
    t = traj([[Span.context(Kind.PROMPT, [1, 2])], [Span.context(Kind.PROMPT, [3]), Span.policy([4], [-0.1], [0])]])
    assert collate([t], PAD).input_ids.tolist() == [[3, 4]]
    with pytest.raises(ConsistencyError, match="no trainable tokens"):
        collate([traj([[Span.context(Kind.PROMPT, [1, 2])]])], PAD)


def test_oldest_version_spans_segments():
    t = traj([[Span.context(Kind.PROMPT, [1]), Span.policy([2, 3], [-0.1, -0.1], [4, 5])],
              [Span.context(Kind.PROMPT, [1]), Span.policy([2], [-0.1], [3])]])
    assert t.oldest_version == 3 and t.num_policy_tokens == 3 and t.status == Status.OK


def test_repeats_counts_the_copies_within_each_group_by_every_policy_token():
    def run(group, *policy, prompt=(1,)):  # a completion: its policy spans' tokens; the prompt does not count
        return traj([[Span.context(Kind.PROMPT, list(prompt))]
                     + [Span.policy(list(p), [-0.1] * len(p), [0] * len(p)) for p in policy]], group=group)

    group0 = [run(0, [5, 6]), run(0, [5, 6], prompt=(2,)), run(0, [5, 6]), run(0, [5], [6]), run(0, [5, 7])]
    group1 = [run(1, [5, 6]), run(1, [8])]  # the same tokens in another group: no copy of group 0's
    # group 0 holds 2 distinct completions in 5 ([5, 6] three times, and a fourth as [5] + [6]: the same tokens in
    # order; [5, 7] once), so 3 of them repeat; group 1 repeats none
    assert repeats(group0) == 3 and repeats(group1) == 0 and repeats(group0 + group1) == 3
    assert repeats([]) == 0
