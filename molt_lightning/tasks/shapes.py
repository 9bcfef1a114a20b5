"""The vision-language task: count the red squares in a small picture drawn by code.

A sample is a 32x32 RGB image (``draw``) holding 1-4 coloured squares, each filling one cell of a 4x4 grid of 8x8
cells (aligned with the tiny policy's 8x8 vision patches, so one square is one image token's worth of pixels), red,
green or blue; the question is ``"How many red squares?"`` and the answer ``ANSWER k`` (k in 0..4). The agent
(``count_agent``) sends one user message with OpenAI/Hugging Face-style content parts (``{"type": "image", "image":
PIL.Image}`` then the text); the client expands the image into its image tokens and carries the pixel values with the
trajectory (``molt_lightning.policies.vision``).

The tiny policy for it (``molt_lightning.models.tiny_vlm``) is warm-started on ``demonstration`` dialogues whose
answer is right with probability ``p_right`` (else a random count), so it starts above chance and has room to learn.
``CHAT_TEMPLATE`` is ChatML that renders an image content part as the ``<image>`` placeholder, once per image (the
policy's processor expands it).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

from .arithmetic import reward  # the same grading: 1.0 for ``ANSWER k`` with the right count, else 0.0

SIZE, CELL = 32, 8  # image side and grid cell, in pixels
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (40, 60, 230)}
QUESTION = "How many red squares?"
MAX_TOKENS = 8
SPECIAL_TOKENS = ["<image>"]  # the image placeholder, one token (train_tokenizer adds it)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def draw(cells: list[tuple[int, int, str]]):
    """A black 32x32 RGB image with a square of ``colour`` filling each grid cell (row, column) in ``cells``."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (SIZE, SIZE), (0, 0, 0))
    pen = ImageDraw.Draw(img)
    for row, col, colour in cells:
        x, y = col * CELL, row * CELL
        pen.rectangle([x + 1, y + 1, x + CELL - 2, y + CELL - 2], fill=COLOURS[colour])
    return img


def make_sample(rng: random.Random) -> dict[str, Any]:
    """1-4 squares in distinct cells, each red with probability 0.5 (else green or blue); ``answer``: the red ones."""
    n = rng.randint(1, 4)
    spots = rng.sample([(r, c) for r in range(SIZE // CELL) for c in range(SIZE // CELL)], n)
    cells = [(r, c, "red" if rng.random() < 0.5 else rng.choice(["green", "blue"])) for r, c in spots]
    return {"image": draw(cells), "question": QUESTION, "answer": sum(c == "red" for *_, c in cells)}


def tasks(seed: int = 0) -> Iterator[dict[str, Any]]:
    """The endless, seeded stream of samples."""
    rng = random.Random(seed)
    while True:
        yield make_sample(rng)


def messages(sample: dict[str, Any]) -> list[dict[str, Any]]:
    """The one user message: the image, then the question."""
    return [{"role": "user", "content": [{"type": "image", "image": sample["image"]},
                                         {"type": "text", "text": sample["question"]}]}]


async def count_agent(client, sample: dict[str, Any]) -> float:
    """The agent program: one message with the image, one reply, scored."""
    return reward(await client.chat(messages(sample), max_tokens=MAX_TOKENS), sample)


def demonstration(rng: random.Random, p_right: float = 1.0) -> list[dict[str, Any]]:
    """A warm-start dialogue: the right count with probability ``p_right``, else a uniform guess in 0..4."""
    sample = make_sample(rng)
    k = sample["answer"] if rng.random() < p_right else rng.randint(0, 4)
    return [*messages(sample), {"role": "assistant", "content": f"ANSWER {k}"}]
