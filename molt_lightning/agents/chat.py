"""Token-exact chat rendering: the one place that turns chat messages into prompt and environment tokens.

The policy's own tokens are never re-tokenized. A multi-turn chat is a growing token list: the first prompt is the
rendered conversation; after each generated turn, only the *template delta* is appended: the closing text the
template puts after an assistant message that the policy did not generate itself (e.g. the ``\\n`` after
``<|im_end|>``), then the new messages (tool results, user turns) and the next generation prompt. When the template
renders the old conversation differently once new messages arrive (history rewritten or a template that edits past
turns), ``delta_ids`` returns ``None`` and the caller starts a new segment instead of re-tokenizing.

Tools: ``tools`` (OpenAI/Hugging Face function schemas) are rendered by the policy's own chat template, and a reply's
tool calls are parsed by the tokenizer's own ``response_template`` (transformers' ``parse_response``), so the
tool-call syntax is the policy's, written down once in its tokenizer config.

Images (vision-language policies): a message's content may be a list of parts, ``{"type": "image", "image":
PIL.Image}`` among ``{"type": "text", ...}``; the template renders each image as its placeholder once, and the
policy's processor (``processor``, e.g. ``LlavaProcessor``) expands it into the image tokens and makes the pixel
values (``vision.encode``). ``prompt_inputs`` and ``delta_inputs`` return both; a delta holds the new messages'
images only (the earlier ones are already in the segment's tokens and spans).

Uses ``transformers``' ``apply_chat_template``, ``parse_response`` and the policy's processor; the delta arithmetic
is ours (no library offers it).
"""

from __future__ import annotations

import os
from functools import cached_property
from typing import Any

from ..policies.vision import ImageInputs, encode, images_in

Message = dict[str, Any]
_PROBE = "\x00molt-probe\x00"


class ChatTemplate:
    """Wraps a tokenizer's chat template for incremental, token-exact rendering."""

    def __init__(self, tokenizer, processor=None):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat_template: `client.chat` needs one. Set tokenizer.chat_template "
                             "(a Jinja string) or use `client.generate` with your own token ids.")
        self.tokenizer, self.processor = tokenizer, processor  # processor: a VLM's (expands images), else None
        self.eos_id: int = tokenizer.eos_token_id  # what a demonstration's turn ends with (SFT, warm starts)
        # the Rust tokenizer behind a fast tokenizer: the same ids as tokenizer(text) at a fraction of the Python cost
        # (a turn's delta is tokenized on every request; tested equal in tests/test_chat.py)
        self._rust = getattr(tokenizer, "_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        probe = self.render([{"role": "user", "content": "u"}, {"role": "assistant", "content": _PROBE}])
        # What the template writes after an assistant message's content, e.g. "<|im_end|>\n".
        self.turn_suffix = probe.split(_PROBE, 1)[1]
        user = [{"role": "user", "content": "u"}]  # what the template writes to open an assistant turn
        self.generation_prompt = self.render(user, add_generation_prompt=True)[len(self.render(user)):]
        first = self.encode(self.turn_suffix)[:1]
        self.end_ids = end_of_turn_ids(tokenizer, first)  # every id that ends a turn
        # what closes a turn that ended on one of them: the suffix after its end-of-turn token (e.g. the "\n" after
        # "<|im_end|>"), whichever end id the policy sampled; the whole suffix when it does not open with one
        closing = tokenizer.decode(first) if first and first[0] in self.end_ids else ""
        self.after_end = self.turn_suffix[len(closing):] if self.turn_suffix.startswith(closing) else self.turn_suffix

    @property
    def image_token_id(self) -> int | None:
        """The image placeholder token of a vision-language policy's processor; None for a text policy."""
        return None if self.processor is None else self.processor.image_token_id

    @property
    def handles_tools(self) -> bool:
        """Whether the template renders ``tools`` and the tokenizer can parse tool calls back out of a reply."""
        return "tools" in str(self.tokenizer.chat_template) and self.response_template is not None

    @property
    def response_template(self) -> dict | None:
        return getattr(self.tokenizer, "response_template", None)

    @cached_property
    def longest_token(self) -> int:
        """The most characters one token stands for (the longest vocabulary string: a byte-level token's string has
        a character per byte, a special token its whole text)."""
        ids = list(range(len(self.tokenizer)))
        return max(1, max((len(t) for t in self.tokenizer.convert_ids_to_tokens(ids) if t), default=1))

    def min_tokens(self, messages: list[Message]) -> int:
        """At least how many tokens ``messages`` render to, without rendering them: their text over
        ``longest_token`` (a tokenizer whose normalizer collapses whitespace could beat it; chat LMs' do not). The
        endpoint refuses a conversation that cannot fit the context with it, before a multi-megabyte render."""
        return sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str)) // self.longest_token

    def render(self, messages: list[Message], add_generation_prompt: bool = False, tools: list | None = None) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        if self._rust is not None:
            return self._rust.encode(text, add_special_tokens=False).ids
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_with_images(self, text: str, images: list) -> tuple[list[int], ImageInputs | None]:
        """``encode``, with ``images`` (PIL) expanded at their placeholders by the processor."""
        if not images:
            return self.encode(text), None
        if self.processor is None:
            raise ValueError("the messages hold images but the policy has no image processor: use a vision-language "
                             "policy folder whose processor loads with AutoProcessor (e.g. "
                             "molt_lightning.models.tiny_vlm.shapes_policy)")
        return encode(self.processor, text, images)

    def prompt_inputs(self, messages: list[Message], tools: list | None = None
                      ) -> tuple[list[int], ImageInputs | None]:
        """The first prompt of a segment (the whole conversation plus the generation prompt) and its images."""
        return self.encode_with_images(self.render(messages, add_generation_prompt=True, tools=tools),
                                       images_in(messages))

    def prompt_ids(self, messages: list[Message], tools: list | None = None) -> list[int]:
        """``prompt_inputs`` for text-only messages."""
        return _text_only(self.prompt_inputs(messages, tools))

    def close_turn_ids(self, generated: list[int]) -> list[int]:
        """Template text after a generated assistant turn that the policy did not produce itself: after any end id,
        the same closing (no token added or lost); a truncated turn gets the whole suffix."""
        return self.encode(self.after_end if generated and generated[-1] in self.end_ids else self.turn_suffix)

    def delta_inputs(self, previous: list[Message], new: list[Message], tools: list | None = None
                     ) -> tuple[list[int], ImageInputs | None] | None:
        """Tokens for ``new`` messages plus the generation prompt and the new messages' images, or ``None`` if the
        prefix does not render stably."""
        before = self.render(previous, tools=tools)
        after = self.render(previous + new, add_generation_prompt=True, tools=tools)
        if not after.startswith(before):
            return None
        return self.encode_with_images(after[len(before):], images_in(new))

    def delta_ids(self, previous: list[Message], new: list[Message], tools: list | None = None) -> list[int] | None:
        """``delta_inputs`` for text-only messages."""
        delta = self.delta_inputs(previous, new, tools)
        return None if delta is None else _text_only(delta)

    def decode_reply(self, generated: list[int]) -> str:
        """The assistant message text of a generated turn (without the end-of-turn token)."""
        ids = generated[:-1] if generated and generated[-1] in self.end_ids else generated
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def parse_reply(self, generated: list[int], tools: list | None = None) -> Message:
        """The assistant message of a generated turn: ``content`` and, where the reply holds some, ``tool_calls``
        (HF form: ``{"type": "function", "function": {"name", "arguments": dict}}``). A reply whose tool-call
        syntax does not parse keeps its raw text as content and gets ``"unparsed": "<why>"``."""
        text = self.decode_reply(generated)
        if not tools or self.response_template is None:
            return {"role": "assistant", "content": text}
        try:
            parsed = self.tokenizer.parse_response(text, prefix=self.generation_prompt, tools=tools)
        except (ValueError, TypeError, KeyError) as e:
            return {"role": "assistant", "content": text, "unparsed": f"{type(e).__name__}: {str(e)[:200]}"}
        calls = [c for c in parsed.get("tool_calls") or [] if isinstance(c, dict)]
        if any(not isinstance(c.get("function"), dict) or not isinstance(c["function"].get("arguments", {}), dict)
               for c in calls):  # e.g. <tool_call>5</tool_call>, or arguments 5: both wires promise an object
            return {"role": "assistant", "content": text, "unparsed": "a tool call or its arguments is not a JSON "
                                                                      "object"}
        message = {"role": "assistant", "content": parsed.get("content") or ""}
        if calls:  # each call's function is an object here (checked above)
            message["tool_calls"] = [{"type": "function", "function": {
                "name": str(c["function"].get("name", "")), "arguments": c["function"].get("arguments") or {}}}
                for c in calls]
        return message


def _text_only(inputs: tuple[list[int], ImageInputs | None]) -> list[int]:
    ids, images = inputs
    if images is not None:
        raise ValueError("these messages hold images: use prompt_inputs / delta_inputs, which return their pixel "
                         "values too")
    return ids


def end_of_turn_ids(tokenizer, template_first: list[int] = ()) -> frozenset[int]:
    """The ids that end an assistant turn, one set for the client and every engine (the client sends them as
    ``stop_token_ids``): the tokenizer's end-of-sequence id, the generation config's (a list for many chat models;
    the model config's where the folder has none) and the special token the chat template closes a turn with
    (``template_first``: the first token of what it writes after an assistant message)."""
    from transformers import AutoConfig, GenerationConfig

    ids, folder = [tokenizer.eos_token_id], getattr(tokenizer, "name_or_path", "")
    if os.path.isfile(os.path.join(folder, "generation_config.json")):
        ids.append(GenerationConfig.from_pretrained(folder).eos_token_id)
    elif os.path.isfile(os.path.join(folder, "config.json")):
        ids.append(AutoConfig.from_pretrained(folder).get_text_config().eos_token_id)
    ids += [t for t in template_first if t in tokenizer.all_special_ids]
    return frozenset(i for x in ids for i in (x if isinstance(x, (list, tuple)) else [x]) if i is not None)


def message_text(content) -> str:
    """A message's text: the content string, or its text parts joined (images and other parts left out)."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or [] if isinstance(p, dict) and p.get("type") == "text")
