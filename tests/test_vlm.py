"""Vision-language policies: image tokens expanded once into the prompt span and never re-tokenized, the engine's
logprobs equal the trainer's with the images (and not with other images), pixel values kept aligned with their rows
by collate and rows_of, the loop end to end on the tiny LLaVA with the consistency invariant, the clear errors, and
the recipe."""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

import pytest
import torch

from molt_lightning.agents.chat import ChatTemplate
from molt_lightning.agents.client import AgentClient
from molt_lightning.engines import TorchEngine
from molt_lightning.engines.base import Sampling
from molt_lightning.policies import load_lm
from molt_lightning.trainer.policy import Policy
from molt_lightning.tasks import shapes
from molt_lightning.trajectory import ConsistencyError, Kind, Span, Trajectory, collate
from molt_lightning.policies.vision import BatchImages, ImageInputs, load_processor

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from inflight import decoding  # noqa: E402
from invariant import Batches, check_trained_tokens, record_generations  # noqa: E402


@pytest.fixture(scope="module")
def vlm_path() -> str:
    from molt_lightning.models.tiny_vlm import shapes_policy

    return shapes_policy()


@pytest.fixture(scope="module")
def processor(vlm_path):
    return load_processor(vlm_path)


@pytest.fixture(scope="module")
def template(processor):
    return ChatTemplate(processor.tokenizer, processor)


@pytest.fixture(scope="module")
def engine(vlm_path):
    engine = TorchEngine(seed=0)
    engine.launch(vlm_path)
    yield engine
    engine.release()


def samples(n: int, seed: int = 0) -> list[dict]:
    stream = shapes.tasks(seed)
    return [next(stream) for _ in range(n)]


def chat_all(engine, template, conversations, max_tokens=6) -> list[Trajectory]:
    """One chat turn per conversation, concurrently (one left-padded engine batch), each its own trajectory."""
    trajs = [Trajectory(i, 0) for i in range(len(conversations))]

    async def run():
        clients = [AgentClient(engine, t, template, 1.0, 256, seed=i) for i, t in enumerate(trajs)]
        await asyncio.gather(*(c.chat(m, max_tokens=max_tokens) for c, m in zip(clients, conversations)))

    engine.call(run())
    for t in trajs:
        t.reward = 1.0
    return trajs


def image_runs(ids: list[int], token_id: int) -> list[int]:
    """The lengths of the runs of ``token_id`` in ``ids``."""
    runs, n = [], 0
    for t in [*ids, -1]:
        if t == token_id:
            n += 1
        elif n:
            runs, n = runs + [n], 0
    return runs


def two_images(a: dict, b: dict) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": a["image"]}, {"type": "text", "text": "and"},
                                         {"type": "image", "image": b["image"]},
                                         {"type": "text", "text": shapes.QUESTION}]}]


def test_image_tokens_are_expanded_once_into_the_prompt_span_and_never_retokenized(engine, template, processor):
    s1, s2 = samples(2)
    [single, double] = chat_all(engine, template, [shapes.messages(s1), two_images(s1, s2)])
    tok_id, per = processor.image_token_id, 16  # (32 / 8)^2 patches, CLS dropped
    for traj, imgs in ((single, [s1["image"]]), (double, [s1["image"], s2["image"]])):
        prompt, gen = traj.segments[0]
        assert prompt.kind == Kind.PROMPT and gen.kind == Kind.POLICY
        assert image_runs(prompt.token_ids, tok_id) == [per] * len(imgs)  # each image's tokens, once
        assert tok_id not in gen.token_ids
        expected = processor.image_processor(imgs, return_tensors="pt")["pixel_values"]  # (n, 3, 32, 32)
        assert prompt.images.pixel_values.shape == (len(imgs), 3, 32, 32)
        assert torch.equal(prompt.images.pixel_values, expected)
    # a second turn with a new image: only the delta is tokenized; the first turn's spans stay as they were
    first = [list(s.token_ids) for s in single.segments[0]]

    async def second_turn():
        client = AgentClient(engine, single, template, 1.0, 256, seed=9)
        client._messages = [*shapes.messages(s1), {"role": "assistant", "content": template.decode_reply(
            single.segments[0][1].token_ids)}]
        client._last_gen = single.segments[0][1].token_ids
        await client.chat([*client._messages, *shapes.messages(s2)], max_tokens=4)

    engine.call(second_turn())
    seg = single.segments[0]
    assert len(single.segments) == 1 and [s.token_ids for s in seg[:2]] == first
    assert seg[2].kind == Kind.ENV and image_runs(seg[2].token_ids, tok_id) == [per]
    assert len(seg[2].images) == 1 and len(seg[0].images) == 1
    b = collate([single], pad_id=0)
    assert b.input_ids[0].tolist()[: sum(map(len, (s.token_ids for s in seg)))] == [t for s in seg for t in s.token_ids]
    assert torch.equal(b.images.pixel_values, torch.cat([seg[0].images.pixel_values, seg[2].images.pixel_values]))


def test_engine_logprobs_equal_the_trainers_with_the_images_and_not_with_others(engine, template, vlm_path):
    s = samples(6, seed=1)
    conversations = [shapes.messages(x) for x in s[:4]] + [two_images(s[4], s[5])]  # unequal: the engine left-pads
    b = collate(chat_all(engine, template, conversations), pad_id=template.tokenizer.pad_token_id)
    assert b.images.pixel_values.shape[0] == 6 and b.images.rows.tolist() == [0, 1, 2, 3, 4, 4]
    policy = Policy(load_lm(vlm_path, torch.float32).eval())
    mask, engine_lp = b.loss_mask[:, 1:], b.engine_logprobs[:, 1:]

    def diff(images):
        with torch.no_grad():
            out = policy.outputs(b.input_ids, b.attention_mask, b.loss_mask, 1.0, images=images)
        return (out.logprobs - engine_lp)[mask].abs()

    assert diff(b.images).max() < 1e-4  # IS ratio 1 at max_lag 0
    swapped = BatchImages(b.images.pixel_values.roll(1, dims=0), b.images.rows)  # each row gets another's picture
    assert diff(swapped).max() > 1e-2  # the pixels reach the trainer's forward


def test_in_flight_update_recomputes_the_context_with_its_images(engine, template, vlm_path):
    """A weight update lands mid-request: the engine recomputes the whole context under the new weights, pixel
    values included (without them the image tokens would be plain embeddings); each token's logprob is then the
    trainer's under the weights its version names."""
    lm = load_lm(vlm_path, torch.float32).eval()
    w0 = {k: v.clone() for k, v in lm.state_dict().items()}
    gen = torch.Generator().manual_seed(3)
    w1 = {k: v + 0.3 * v.std().nan_to_num() * torch.randn(v.shape, generator=gen) for k, v in w0.items()}
    inputs = [template.prompt_inputs(shapes.messages(x)) for x in samples(3, seed=2)]
    long = Sampling(max_tokens=200, temperature=1.0, ignore_eos=True)  # 29 + 200 tokens: within the 256 context

    async def scenario():
        with decoding(engine, steps=5) as generating:  # the update lands after a few decode steps of the batch
            tasks = [asyncio.ensure_future(engine.generate(ids, long, images=im)) for ids, im in inputs]
            assert await asyncio.to_thread(generating.wait, 120), "no decode steps within 120 s"
        await engine.update_weights(w1, 11)
        return await asyncio.gather(*tasks)

    try:
        engine.call(engine.update_weights(w0, 10))
        outs = engine.call(scenario())
    finally:
        engine.call(engine.update_weights(w0, 0))
    assert any(set(o.versions) == {10, 11} for o in outs), "no request was in flight during the update"
    trajs = [Trajectory(i, 0, [[Span.context(Kind.PROMPT, ids, im), Span.policy(o.token_ids, o.logprobs, o.versions)]],
                        reward=1.0) for i, ((ids, im), o) in enumerate(zip(inputs, outs))]
    b = collate(trajs, pad_id=template.tokenizer.pad_token_id)
    mask = b.loss_mask[:, 1:]
    for version, state in ((10, w0), (11, w1)):
        lm.load_state_dict(state)
        with torch.no_grad():
            out = Policy(lm).outputs(b.input_ids, b.attention_mask, b.loss_mask, 1.0, images=b.images)
        sel = mask & (b.versions[:, 1:] == version)
        assert sel.any()
        assert (out.logprobs - b.engine_logprobs[:, 1:])[sel].abs().max() < 1e-3, f"version {version} disagrees"


def fake_images(n: int, value: float) -> ImageInputs:
    return ImageInputs(torch.full((n, 3, 4, 4), value), token_id=99, tokens_per_image=2)


def test_collate_and_rows_of_keep_pixel_values_with_their_rows():
    from molt_lightning.trainer.plan import rows_of

    def traj(i: int, n_images: int, pad: int):
        prompt = Span.context(Kind.PROMPT, [1] + [99] * 2 * n_images + [5] * pad,
                              fake_images(n_images, float(i)) if n_images else None)
        return Trajectory(i, i, [[prompt, Span.policy([7, 8], [-0.1, -0.2], [0, 0])]], reward=1.0)

    b = collate([traj(0, 1, 3), traj(1, 0, 0), traj(2, 2, 0)], pad_id=0)
    assert b.images.rows.tolist() == [0, 2, 2]
    assert b.images.pixel_values[:, 0, 0, 0].tolist() == [0.0, 2.0, 2.0]
    sub = rows_of(b, [2, 0])
    assert sub.images.rows.tolist() == [0, 0, 1]  # renumbered in the sub-batch's order
    assert sub.images.pixel_values[:, 0, 0, 0].tolist() == [2.0, 2.0, 0.0]
    assert sub.input_ids.shape[1] == b.input_ids.shape[1]  # row 0 is the widest
    assert rows_of(b, [1]).images is None  # a text-only row has none
    assert b.to("cpu").images.rows.tolist() == [0, 2, 2]
    assert collate([traj(1, 0, 0)], pad_id=0).images is None
    bad = Span.context(Kind.PROMPT, [1, 99, 5], fake_images(1, 0.0))  # 1 image token for an image of 2
    with pytest.raises(ConsistencyError, match="1 image tokens for 1 images of 2"):
        collate([Trajectory(0, 0, [[bad, Span.policy([7], [-0.1], [0])]], reward=1.0)], pad_id=0)


@pytest.mark.slow
def test_loop_trains_on_exactly_the_engines_tokens_with_the_images_it_saw(vlm_path, tmp_path, monkeypatch):
    from test_loop import fit, make

    engine = TorchEngine(seed=0)
    records = record_generations(engine, monkeypatch)
    seen = []  # (prompt ids, the pixel values the engine got with them, its output)
    recorded = engine.generate

    async def generate(prompt_ids, sampling, images=None):
        out = await recorded(prompt_ids, sampling, images)
        seen.append((list(prompt_ids), images.pixel_values, out))
        return out

    monkeypatch.setattr(engine, "generate", generate)
    batches = Batches()
    processor = load_processor(vlm_path)
    _, df = fit(make(engine, policy=vlm_path, agent=shapes.count_agent, tasks=shapes.tasks, max_lag=0, lr=1e-3),
                tmp_path, steps=3, callbacks=[batches])
    check_trained_tokens(records, batches, processor.tokenizer, max_lag=0)
    assert (df["mismatch/abs_logprob_diff"].dropna() < 1e-4).all()
    assert ((df["is/ratio_max"].dropna() - 1).abs() < 1e-3).all()
    assert df["reward"].notna().sum() == 3
    for _, b in batches.seen:  # each row's pixel values are those of the request that generated its tokens
        for row in range(b.input_ids.shape[0]):
            ids, start = b.input_ids[row].tolist(), b.loss_mask[row].tolist().index(True)
            end = start + int(b.loss_mask[row].sum())
            pixels = b.images.pixel_values[b.images.rows == row]  # (1, 3, 32, 32)
            same = [torch.equal(pixels, px) for p, px, o in seen if p == ids[:start] and o.token_ids == ids[start:end]
                    and torch.allclose(b.engine_logprobs[row, start:end], torch.tensor(o.logprobs))]
            assert any(same) and len(pixels) == 1


def test_engines_without_images_and_text_policies_give_clear_errors(policy_path, vlm_path, tokenizer, template):
    from scripted import ScriptedEngine

    from molt_lightning.agents.sessions import AgentSessions
    from molt_lightning.engines import VLLMEngine

    scripted = ScriptedEngine([[5]])
    with pytest.raises(NotImplementedError, match="ScriptedEngine cannot condition on images.*TorchEngine"):
        asyncio.run(scripted.generate([1, 2], Sampling(max_tokens=1), images=fake_images(1, 0.0)))
    with pytest.raises(ValueError, match="vision-language policy but VLLMEngine cannot take images.*TorchEngine"):
        AgentSessions(VLLMEngine(), vlm_path, template.tokenizer, temperature=1.0, max_context=256)
    with pytest.raises(ValueError, match="no image processor"):
        ChatTemplate(tokenizer).prompt_inputs(shapes.messages(samples(1)[0]))
    with pytest.raises(ValueError, match="use prompt_inputs"):
        template.prompt_ids(shapes.messages(samples(1)[0]))


def test_a_generated_image_placeholder_fails_the_trajectory_and_never_reaches_a_batch(template):
    from scripted import ScriptedEngine

    from molt_lightning.agents.client import GeneratedImagePlaceholder

    class ScriptedVision(ScriptedEngine):  # takes images and ignores them: this test is about its reply
        accepts_images = True

        async def _generate(self, prompt_ids, sampling, images=None):
            return await super()._generate(prompt_ids, sampling)

    placeholder = template.image_token_id
    engine = ScriptedVision([[placeholder, template.eos_id]])
    engine.launch("scripted")
    try:
        traj = Trajectory(0, 0)
        client = AgentClient(engine, traj, template, 1.0, 256)
        with pytest.raises(GeneratedImagePlaceholder, match=f"image placeholder token \\(id {placeholder}\\)"):
            engine.call(client.chat(shapes.messages(samples(1)[0]), max_tokens=4))
    finally:
        engine.release()
    traj.reward = 0.0  # had it not failed: collate refuses the extra image token
    with pytest.raises(ConsistencyError, match="17 image tokens for 1 images of 16"):
        collate([traj], pad_id=0)


def test_shapes_task_draws_counts_and_scores():
    rng = random.Random(0)
    sample = shapes.make_sample(rng)
    img = sample["image"]
    assert img.size == (32, 32) and 0 <= sample["answer"] <= 4
    red = sum(img.getpixel((c * 8 + 4, r * 8 + 4)) == shapes.COLOURS["red"] for r in range(4) for c in range(4))
    assert red == sample["answer"]
    assert shapes.reward(f"ANSWER {red}", sample) == 1.0 and shapes.reward(f"ANSWER {red + 1}", sample) == 0.0
    assert shapes.reward("ANSWER", sample) == 0.0


@pytest.mark.slow
def test_vlm_recipe_parses_and_trains(tmp_path):
    from test_cli import fit_recipe

    _, _, config, df = fit_recipe("vlm", tmp_path)
    assert "TorchEngine" in config and "shapes_policy" in config and "count_agent" in config
    assert df["reward"].notna().any()


def test_shipped_vlm_is_its_specs_build_and_starts_above_chance(vlm_path, template):
    import json

    from molt_lightning.models import tiny, tiny_vlm

    folder = Path(vlm_path)
    assert folder.parent == tiny.PREBUILT and folder.name == tiny.folder_name(tiny_vlm.VLM_SPEC)
    recorded = json.loads((folder / "molt_spec.json").read_text())
    built = recorded.pop("built")
    assert recorded == tiny_vlm.VLM_SPEC and max(built["phase1_round_success"]) >= tiny_vlm.VLM_SPEC["sft"]["target"]
    assert sum(f.stat().st_size for f in folder.iterdir()) < 3 * 2**20
    lm = load_lm(vlm_path, torch.float32).eval()
    success = tiny_vlm.answer_success(lm, template, template.tokenizer.pad_token_id, n=128)
    assert abs(success - built["answer_success"]) < 0.1  # what the build recorded (another sample of images)
    assert 0.3 < success < 0.8  # above chance (about 0.25 for the answer prior), room to learn
