"""The tiny vision-language policy: a random-init LLaVA (tiny CLIP vision tower + tiny Llama), made offline by this
code and warm-started on the red-squares task (``tasks.shapes``).

``shapes_policy()`` returns a Hugging Face folder that ``AutoModelForImageTextToText`` and ``AutoProcessor`` load
offline: a ``LlavaForConditionalGeneration`` (CLIP vision tower: 32x32 images in 8x8 patches, i.e. 16 image tokens,
width 32, 2 layers; a 2-layer projector; the default tiny Llama's text model), a ``LlavaProcessor`` (the CLIP image
processor, ``CLIPImageProcessorPil``, and the task's byte-level BPE with an ``<image>`` token; its chat template
renders image content parts as ``<image>``), and the warm start: phase 1 on right answers until the policy gives the
right count with probability ``target`` (temperature 1), phase 2 on answers that are right with probability
``p_final`` (else a uniform guess), so RL starts above chance (expected reward near ``p_final + (1 - p_final) / 5``)
with the skill to sharpen already present. Same pieces as ``models.tiny`` (tokenizer training, padding, cache,
shipped-build lookup), extended there, not copied.

Shipped like the text policies (``models/prebuilt/``; ``python -m molt_lightning.models.tiny_vlm`` rebuilds
it, a few CPU-minutes). On the CPU it is served by the ``TorchEngine``: vLLM's LLaVA code imports torchvision, which
PyPI builds only for CUDA (see ``molt_lightning.policies.vision``). Hand-written: the build recipe (no library makes a
tiny VLM policy for a task).
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

from .tiny import PREBUILT, SPEC, cached_folder, cosine, folder_name, ship, train_tokenizer

log = logging.getLogger(__name__)

VLM_SPEC = {
    "builder": 1, "task": "shapes", "arch": "llava", "vocab_size": 300,  # 256 bytes + specials + a few merges
    "model": SPEC["model"],  # the default tiny Llama as the text model
    "vision": {"image_size": 32, "patch_size": 8, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
               "num_attention_heads": 2},
    "sft": {"rounds": [800, 600], "target": 0.8, "final_steps": 150, "final_lr": 3e-4, "batch": 32, "lr": 1e-3,
            "p_final": 0.3, "seed": 0},
}


def shapes_policy(spec: dict | None = None) -> str:
    """Path of the warm-started VLM folder: the shipped build, else the cached one, built on first use."""
    spec = spec or VLM_SPEC
    name = folder_name(spec)
    if (PREBUILT / name / "model.safetensors").exists():
        return str(PREBUILT / name)
    return cached_folder(name, lambda out: build(out, spec))


def make_processor(tokenizer, vision: dict):
    """``LlavaProcessor``: the CLIP image processor at the tower's size and ``tokenizer`` (with its ``<image>``)."""
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil  # no torchvision needed

    side = vision["image_size"]
    images = CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    return LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=vision["patch_size"],
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,  # CLS dropped
                          image_token="<image>", chat_template=tokenizer.chat_template)


def make_model(tokenizer, spec: dict):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    text = LlamaConfig(vocab_size=len(tokenizer), tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **spec["model"])
    config = LlavaConfig(vision_config=CLIPVisionConfig(**spec["vision"]), text_config=text,
                         image_token_id=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-1,
                         vision_feature_select_strategy="default", tie_word_embeddings=True)
    return LlavaForConditionalGeneration(config).float()


def sft_example(template, dialogue: list[dict]):
    """Token ids, loss mask and images of a one-turn dialogue, built as ``AgentClient.chat_turn`` builds a rollout."""
    ids, images = template.prompt_inputs(dialogue[:-1])
    gen = template.encode(dialogue[-1]["content"]) + [template.eos_id]
    return (ids + gen, [0] * len(ids) + [1] * len(gen)), images


def _inputs(template, dialogues: list[list[dict]], pad: int):
    import torch

    from ..trainer.sft import collate

    examples = [sft_example(template, d) for d in dialogues]
    ids, labels, _ = collate([e for e, _ in examples], pad)  # (B, T), (B, T)
    pixels = torch.cat([im.pixel_values for _, im in examples])  # (B, 3, H, W): one image per dialogue
    return ids, labels, pixels


def answer_success(model, template, pad: int, n: int = 256, seed: int = 12345) -> float:
    """Mean probability (temperature 1) of the whole right reply (``ANSWER k`` and end of turn): the expected reward
    of the task at the start of RL."""
    import torch

    from ..tasks import shapes

    rng = random.Random(seed)
    ids, labels, pixels = _inputs(template, [shapes.demonstration(rng, 1.0) for _ in range(n)], pad)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=(ids != pad).long(), pixel_values=pixels).logits[:, :-1]
    targets, mask = labels[:, 1:], labels[:, 1:] != -100  # (B, T-1)
    logp = torch.log_softmax(logits.float(), -1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    return float(torch.exp((logp * mask).sum(-1)).mean())


def build(out: Path, spec: dict) -> None:
    """Tokenizer and processor, random init, then the two supervised phases (see the module docstring)."""
    import torch

    from ..agents.chat import ChatTemplate
    from ..tasks import shapes

    sft = spec["sft"]
    torch.manual_seed(sft["seed"])
    tokenizer = train_tokenizer(spec["vocab_size"], sft["seed"], shapes)
    processor = make_processor(tokenizer, spec["vision"])
    model = make_model(tokenizer, spec)
    template, pad = ChatTemplate(tokenizer, processor), tokenizer.pad_token_id
    rng = random.Random(sft["seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=sft["lr"], weight_decay=0.0)

    def step(p_right: float, lr: float) -> None:
        for group in opt.param_groups:
            group["lr"] = lr
        ids, labels, pixels = _inputs(template, [shapes.demonstration(rng, p_right) for _ in range(sft["batch"])],
                                      pad)
        model(input_ids=ids, attention_mask=(ids != pad).long(), pixel_values=pixels, labels=labels).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    model.train()
    rounds = []
    for r, n in enumerate(sft["rounds"]):  # annealed rounds on right answers until the count is reliable
        log.warning("building the tiny VLM %s (no shipped build of this spec; cached once built): phase-1 round %d, "
                    "%d steps", folder_name(spec), r + 1, n)
        for i in range(n):
            step(1.0, cosine(i, n, sft["lr"] / (1 + r)))
        model.eval()
        rounds.append(answer_success(model, template, pad))
        model.train()
        if rounds[-1] >= sft["target"]:
            break
    for i in range(sft["final_steps"]):  # then dilute: right with probability p_final, else a guess
        step(sft["p_final"], sft["final_lr"] * (1 - i / sft["final_steps"]))
    model.eval()
    final = answer_success(model, template, pad)
    log.warning("built the tiny VLM: right-answer probability %.3f after phase-1 rounds %s", final,
                [round(x, 3) for x in rounds])
    spec = {**spec, "built": {"phase1_round_success": rounds, "answer_success": final}}
    model.generation_config.pad_token_id = pad
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)  # tokenizer, image processor, chat template: AutoProcessor loads the folder
    (out / "molt_spec.json").write_text(json.dumps(spec, indent=1))


if __name__ == "__main__":  # rebuild the shipped VLM: python -m molt_lightning.models.tiny_vlm
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    print(ship(VLM_SPEC, build))
