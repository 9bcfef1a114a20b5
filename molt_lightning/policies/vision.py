"""Vision-language policies: the typed image records that travel from an agent's message to the engine and trainer.

How images flow (LLaVA-style policies: a vision tower whose features replace placeholder tokens in the prompt):
1. An agent sends messages with OpenAI/Hugging Face content parts (``{"type": "image", "image": PIL.Image}``). The
   chat template renders each image as its placeholder (``<image>``) once; ``chat.ChatTemplate`` hands that text and
   the images to the policy's own processor (``processor(text=..., images=...)``), which expands each placeholder into
   its image tokens and makes the pixel values. Those ids become the prompt (or environment) span, never re-tokenized.
2. The pixel values ride on that span as an ``ImageInputs`` (``Span.images``); the client gives the engine all of its
   segment's images with the prompt (``RolloutEngine.generate(prompt_ids, sampling, images=...)``), and the torch
   engine passes them on every full-context forward (the prefill, and the recompute after a weight update); decode
   steps read the KV cache only, so the engine's logprobs are those of the image-conditioned policy.
3. ``trajectory.collate`` puts every row's images into one ``BatchImages`` (``Batch.images``): the processor's own
   per-image tensors concatenated in row order, each image tagged with its row; ``batching.rows_of`` selects a
   micro-batch's images with its rows; ``Policy.forward`` passes them to the LM in its one forward call.

What runs where: on the CPU the ``TorchEngine`` serves a VLM (``accepts_images``). vLLM's vision models (LLaVA,
Qwen2-VL) import torchvision, whose PyPI builds need CUDA, so ``VLLMEngine`` refuses images with an error naming the
torch engine; on GPUs a user would install CUDA torch + torchvision + vLLM, and wiring vLLM's ``multi_modal_data``
in is future work. Deviations: only processors with a fixed output size per image (CLIP: every image resized and
cropped to one size) are collated; processors with variable sizes (Qwen2-VL's patches plus ``image_grid_thw``) raise.
Written by hand: the records and their collation (no library keeps pixel values aligned with RL trajectory rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ImageInputs:
    """The images whose placeholder tokens one span (or one request's prompt) holds, in placeholder order."""

    pixel_values: torch.Tensor  # (n, 3, H, W) float32, the processor's output
    token_id: int  # the image token id; each image is ``tokens_per_image`` of them in the span
    tokens_per_image: int

    def __len__(self) -> int:
        return self.pixel_values.shape[0]

    @staticmethod
    def cat(parts: list[ImageInputs | None]) -> ImageInputs | None:
        """The images of several spans, in order; None when none has any."""
        parts = [p for p in parts if p is not None]
        if not parts:
            return None
        check_same_size([p.pixel_values for p in parts])
        return ImageInputs(torch.cat([p.pixel_values for p in parts]), parts[0].token_id, parts[0].tokens_per_image)


@dataclass
class BatchImages:
    """A batch's images: what the LM's forward takes for its (N, T) token rows."""

    pixel_values: torch.Tensor  # (M, 3, H, W): every image of the batch, row by row, in placeholder order
    rows: torch.Tensor  # (M,) long: the batch row each image belongs to (non-decreasing)

    def select(self, rows: list[int]) -> BatchImages | None:
        """The images of ``rows`` (a sub-batch, in that order), their rows renumbered 0..len(rows)-1."""
        picked = [(new, (self.rows == old).nonzero().flatten()) for new, old in enumerate(rows)]
        picked = [(new, idx) for new, idx in picked if idx.numel()]
        if not picked:
            return None
        idx = torch.cat([i for _, i in picked])  # (m,)
        new_rows = torch.cat([torch.full((i.numel(),), new, dtype=torch.long) for new, i in picked])
        return BatchImages(self.pixel_values[idx], new_rows.to(self.rows.device))

    def to(self, device) -> BatchImages:
        return BatchImages(self.pixel_values.to(device), self.rows.to(device))


def collate_images(rows: list[ImageInputs | None]) -> BatchImages | None:
    """``Batch.images`` from each row's images (None: a row without any); None when no row has one."""
    if all(r is None for r in rows):
        return None
    present = [(i, r) for i, r in enumerate(rows) if r is not None]
    check_same_size([r.pixel_values for _, r in present])
    return BatchImages(torch.cat([r.pixel_values for _, r in present]),
                       torch.cat([torch.full((len(r),), i, dtype=torch.long) for i, r in present]))


def check_same_size(tensors: list[torch.Tensor]) -> None:
    shapes = {tuple(t.shape[1:]) for t in tensors}
    if len(shapes) > 1:
        raise ValueError(f"images of different processed sizes {sorted(shapes)}: only processors that resize every "
                         "image to one size (LLaVA's CLIP processor) are supported; for variable-size processors "
                         "(Qwen2-VL) the image grid field is not wired in yet")


def images_in(messages: list[dict[str, Any]]) -> list:
    """The images of ``messages``' content parts (``{"type": "image", "image": PIL.Image}``), in order."""
    return [p["image"] for m in messages if isinstance(m.get("content"), list) for p in m["content"]
            if isinstance(p, dict) and p.get("type") == "image"]


def load_processor(folder: str):
    """The policy folder's multimodal processor (with an ``image_processor``: LLaVA's), or None for a text policy."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)
    return processor if getattr(processor, "image_processor", None) is not None else None


def encode(processor, text: str, images: list) -> tuple[list[int], ImageInputs]:
    """Token ids of ``text`` with each of its image placeholders expanded by ``processor``, and the pixel values."""
    placeholders = text.count(processor.image_token)
    if placeholders != len(images):
        raise ValueError(f"the rendered messages hold {placeholders} image placeholders for {len(images)} images: "
                         "the chat template must render each image content part as the processor's "
                         f"{processor.image_token!r} once")
    out = processor(text=text, images=images, add_special_tokens=False, return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    per_image = ids.count(processor.image_token_id) // len(images)
    return ids, ImageInputs(out["pixel_values"].float(), processor.image_token_id, per_image)
