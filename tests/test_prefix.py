"""Shared-prefix packing (``prefix``): the packed forward gives the unpacked forward's logprobs, entropies and
gradients, computes each shared prompt once, and leaves alone what it cannot pack."""

import random

import pytest
import torch

from molt_lightning.trainer import prefix
from molt_lightning.trainer.policy import Policy


def rows_batch(seed: int = 0, vocab: int = 280):
    """Right-padded rows: 3 prompts of different lengths with 4, 3 and 1 samples, one sample a two-turn row (prompt,
    answer, tool reply, answer), one answer identical to another; loss mask on the answers."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    rows = []
    for plen, samples in [(9, 4), (13, 3), (6, 1)]:
        prompt = tok(plen)
        answers = [tok(rng.randint(1, 7)) for _ in range(samples)]
        if samples == 4:
            answers[1] = list(answers[0])  # two identical samples: all of the second row is shared
        for i, a in enumerate(answers):
            ids, mask = prompt + a, [False] * plen + [True] * len(a)
            if plen == 13 and i == 0:  # a second turn: tool reply, then another answer
                tool, again = tok(4), tok(3)
                ids, mask = ids + tool + again, mask + [False] * 4 + [True] * 3
            rows.append((ids, mask))
    width = max(len(r[0]) for r in rows)
    pad = lambda x, v: x + [v] * (width - len(x))  # noqa: E731
    return (torch.tensor([pad(r[0], 0) for r in rows]), torch.tensor([pad([True] * len(r[0]), False) for r in rows]),
            torch.tensor([pad(r[1], False) for r in rows]))


@pytest.fixture(params=["sdpa", "eager"])
def policies(request, policy_path):
    from transformers import AutoModelForCausalLM

    lm = lambda: AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32,  # noqa: E731
                                                      attn_implementation=request.param)
    return Policy(lm(), share_prefix=True), Policy(lm(), share_prefix=False)


def test_pack_layout_counts_each_shared_prompt_once():
    ids, att, loss = rows_batch()
    packed = prefix.pack(ids, att, loss)
    lengths = att.sum(-1).tolist()
    # each prompt's rows share the prompt (9 and 13 tokens) and their own first answer token's predecessor is in it;
    # the lone row (6 + answer) is packed alone
    shared = 3 * 9 + 2 * 13
    assert packed.unpacked_tokens == sum(lengths) and packed.tokens == sum(lengths) - shared
    assert packed.input_ids.shape[0] == 3
    flat_ids = packed.input_ids.reshape(-1)
    assert torch.equal(flat_ids[packed.index][att], ids[att])  # every valid position maps to its own token
    flat_pos = packed.position_ids.reshape(-1)
    assert torch.equal(flat_pos[packed.index][att], torch.arange(ids.shape[1]).expand_as(ids)[att])


def test_pack_refuses_what_it_cannot_save_or_read():
    ids, att, loss = rows_batch()
    lone = [0, 4, 7]  # one row of each prompt: nothing shared
    assert prefix.pack(ids[lone], att[lone], loss[lone]) is None
    left = att.clone()
    left[0] = left[0].roll(1)  # padding before the tokens
    assert prefix.pack(ids, left, loss) is None


def test_packed_forward_equals_unpacked(policies):
    packed_policy, plain = policies
    ids, att, loss = rows_batch()
    a = packed_policy(ids, att, loss, 0.7, entropy_grad=True)
    b = plain(ids, att, loss, 0.7, entropy_grad=True)
    sel = loss[:, 1:]
    assert float(a[4]["batch/decoder_tokens_frac"]) < 0.7 and float(b[4]["batch/decoder_tokens_frac"]) == 1.0
    assert torch.allclose(a[0][sel], b[0][sel], atol=1e-5) and torch.allclose(a[1][sel], b[1][sel], atol=1e-5)
    assert (a[0][~sel] == 0).all() and (a[0][sel] != 0).all()
    weights = torch.randn(sel.shape, generator=torch.Generator().manual_seed(0))
    for policy, out in [(packed_policy, a), (plain, b)]:
        ((out[0] * weights).sum() + 0.1 * (out[1] * weights).sum()).backward()
    grads = [(p.grad, q.grad) for p, q in zip(packed_policy.parameters(), plain.parameters()) if q.grad is not None]
    assert len(grads) == len(list(plain.parameters()))
    for g, h in grads:
        assert torch.isfinite(g).all()
        assert (g - h).norm() <= 1e-5 * h.norm()  # float32 rounding of a different summation order


def test_unsupported_policies_are_not_packed(policy_path):
    from transformers import AutoModelForCausalLM

    from molt_lightning.models.tiny import moe_policy

    moe = AutoModelForCausalLM.from_pretrained(moe_policy(), dtype=torch.float32)
    assert "mixture-of-experts" in prefix.supported(moe) and Policy(moe).pack_kernel is None
    flex = AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32)
    flex.config._attn_implementation = "flex_attention"
    assert "takes no custom 4D mask" in prefix.supported(flex)
