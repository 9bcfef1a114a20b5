"""Chat turns become tokens by template deltas; policy tokens are never re-tokenized."""

import asyncio
import sys
from pathlib import Path

import pytest

from molt_lightning.agents.chat import ChatTemplate
from molt_lightning.agents.client import AgentClient
from molt_lightning.trajectory import Kind, Trajectory

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from scripted import ScriptedEngine  # noqa: E402


def test_incremental_turns_equal_rendering_the_whole_conversation(tokenizer):
    t = ChatTemplate(tokenizer)
    conv = [{"role": "user", "content": "What is 12*34?"}, {"role": "assistant", "content": "CALC 12*34"},
            {"role": "tool", "content": "408"}, {"role": "assistant", "content": "ANSWER 408"}]
    ids = t.prompt_ids(conv[:1])
    gen1 = t.encode("CALC 12*34") + [t.eos_id]
    ids += gen1 + t.close_turn_ids(gen1) + t.delta_ids(conv[:2], conv[2:3])
    gen2 = t.encode("ANSWER 408") + [t.eos_id]
    ids += gen2 + t.close_turn_ids(gen2)
    assert ids == t.encode(t.render(conv))
    assert t.turn_suffix == "<|im_end|>\n"


def test_truncated_turn_is_closed_by_the_template(tokenizer):
    t = ChatTemplate(tokenizer)
    assert t.close_turn_ids(t.encode("CALC 1")) == t.encode("<|im_end|>\n")
    assert t.close_turn_ids(t.encode("CALC 1") + [t.eos_id]) == t.encode("\n")


def test_client_keeps_generated_ids_and_masks_tool_turns(tokenizer):
    t = ChatTemplate(tokenizer)
    # A reply whose ids are NOT the canonical tokenization of its text: re-tokenizing would change them.
    odd = [t.encode("C")[0], t.encode("A")[0], t.encode("L")[0], t.encode("C")[0]] + t.encode(" 1+1") + [t.eos_id]
    final = t.encode("ANSWER 2") + [t.eos_id]
    engine = ScriptedEngine([odd, final], version=7)
    traj = Trajectory(sample_id=0, group_id=0)
    client = AgentClient(engine, traj, t, temperature=1.0, max_context=256)

    async def agent():
        msgs = [{"role": "user", "content": "What is 1+1?"}]
        reply = await client.chat(msgs, max_tokens=8)
        msgs += [{"role": "assistant", "content": reply}, {"role": "tool", "content": "2"}]
        return reply, await client.chat(msgs, max_tokens=8)

    r1, r2 = asyncio.run(agent())
    assert (r1, r2) == ("CALC 1+1", "ANSWER 2")
    [segment] = traj.segments
    kinds = [s.kind for s in segment]
    assert kinds == [Kind.PROMPT, Kind.POLICY, Kind.ENV, Kind.POLICY]
    assert segment[1].token_ids == odd and segment[3].token_ids == final
    assert tokenizer.decode(segment[2].token_ids) == "\n<|im_start|>tool\n2<|im_end|>\n<|im_start|>assistant\n"
    assert engine.prompts[1] == [tok for s in segment[:3] for tok in s.token_ids]  # the second turn continues it


def test_rewritten_history_starts_a_new_segment(tokenizer):
    t = ChatTemplate(tokenizer)
    engine = ScriptedEngine([t.encode("CALC 1+1") + [t.eos_id], t.encode("ANSWER 2") + [t.eos_id]], version=7)
    traj = Trajectory(sample_id=0, group_id=0)
    client = AgentClient(engine, traj, t, temperature=1.0, max_context=256)

    async def agent():
        await client.chat([{"role": "user", "content": "What is 1+1?"}], max_tokens=8)
        # the agent summarises instead of appending: not an extension of what the segment holds
        await client.chat([{"role": "user", "content": "1+1 is 2. Answer."}], max_tokens=8)

    asyncio.run(agent())
    assert len(traj.segments) == 2
    assert [s.kind for s in traj.segments[1]] == [Kind.PROMPT, Kind.POLICY]


def test_template_that_edits_past_turns_starts_a_new_segment(tokenizer):
    tok = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tok.chat_template = "[{{ messages|length }} messages]" + tokenizer.chat_template  # the prefix changes each turn
    t = ChatTemplate(tok)
    assert t.delta_ids([{"role": "user", "content": "a"}], [{"role": "tool", "content": "b"}]) is None


def test_chat_without_template_is_a_clear_error(tokenizer):
    tok = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat_template"):
        ChatTemplate(tok)


@pytest.mark.parametrize("policy", ["arithmetic_policy", "python_tool_policy"])
def test_fast_encode_equals_the_tokenizers_own_call(policy):
    """``ChatTemplate.encode`` calls the Rust tokenizer directly: the ids must be the tokenizer's, special tokens and
    odd text included."""
    from transformers import AutoTokenizer

    from molt_lightning.models import tiny

    tok = AutoTokenizer.from_pretrained(getattr(tiny, policy)())
    t = ChatTemplate(tok)
    assert t._rust is not None
    texts = ["What is 12*34?", "<|im_end|>\n<|im_start|>assistant\n", " leading and  double  spaces ", "ünïcödé ✓ 数",
             '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>', "\n\n\t", "a<|pad|>b",
             t.render([{"role": "user", "content": "x"}], add_generation_prompt=True)]
    for text in texts:
        assert t.encode(text) == tok(text, add_special_tokens=False)["input_ids"], text


def test_a_refused_generate_leaves_the_trajectory_as_it_was(tokenizer):
    from molt_lightning.agents.client import ContextOverflow

    t = ChatTemplate(tokenizer)
    engine = ScriptedEngine([t.encode("ANSWER 2") + [t.eos_id]], version=1)
    traj = Trajectory(sample_id=0, group_id=0)
    client = AgentClient(engine, traj, t, temperature=1.0, max_context=16)
    with pytest.raises(ContextOverflow, match="segment of 12 tokens \\+ max_tokens 8 exceeds max_context 16"):
        asyncio.run(client.generate(list(range(12)), max_tokens=8))
    assert traj.segments == [[]] and engine.prompts == []  # no prompt-only span, no engine call
    asyncio.run(client.generate(list(range(4)), max_tokens=8))  # the agent shortens its context and goes on
    assert [s.kind for s in traj.segments[-1]] == [Kind.PROMPT, Kind.POLICY]
