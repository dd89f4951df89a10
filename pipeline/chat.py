"""Prompt rows to token ids: chat messages through the tokenizer's chat template, text as is.

The driver renders each row once with the tokenizer the actor uses, so every role sees the
same ids and a checkpoint's prompt position names the same tokens again.
"""

from __future__ import annotations

from typing import Any

from pipeline.config import TrainConfig
from pipeline.data import PromptRow, PromptStream, fit_rows_to_context, read_rows


class ChatTemplateError(ValueError):
    """Chat prompts that cannot be rendered as asked: the message names the fix."""


def render_prompts(tokenizer, rows: list[PromptRow], *, chat_template: bool | None = None,
                   system_prompt: str = "", tokenizer_dir: Any = "the policy's tokenizer") -> list[list[int]]:
    """The token ids of every row's prompt.

    `chat_template` (train.chat_template): None renders message lists with the chat template
    and encodes text as it is; True also wraps a text prompt as one user message; False
    refuses message lists (a model without a template cannot read them). `system_prompt`,
    when set, is put before every conversation that has no system message of its own.
    Rendering ends with the template's generation prompt (the assistant's turn opening).
    """
    chats = [i for i, row in enumerate(rows) if row.is_chat]
    if chats and chat_template is False:
        raise ChatTemplateError(f"prompt {chats[0]} (and {len(chats) - 1} more) is a list of chat messages, but "
                                f"train.chat_template is false. Fix: set chat_template: true (or leave it out), "
                                f"or give the prompts as text.")
    templated = chat_template is True or bool(chats)
    if templated and not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(f"{tokenizer_dir} has no chat template, so chat prompts cannot be rendered. Fix: "
                                f"use an instruct model's tokenizer, save a chat_template.jinja beside the model "
                                f"(tokenizer.chat_template = ...; tokenizer.save_pretrained(dir)), or give plain "
                                f"text prompts with chat_template: false.")
    return [_render(tokenizer, row, chat_template, system_prompt) for row in rows]


def conversation(row: PromptRow, system_prompt: str = "") -> list[dict[str, str]]:
    """The messages a row's prompt is rendered from (a text prompt: one user message)."""
    messages = list(row.prompt) if row.is_chat else [{"role": "user", "content": row.prompt}]
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _render(tokenizer, row: PromptRow, chat_template: bool | None, system_prompt: str) -> list[int]:
    if not row.is_chat and chat_template is not True:
        return tokenizer(row.prompt, add_special_tokens=False)["input_ids"]
    ids = tokenizer.apply_chat_template(conversation(row, system_prompt), add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    return list(ids)


def prompt_stream(source: Any, tokenizer, tc: TrainConfig, context: int | None, tokenizer_dir: Any) -> PromptStream:
    """The rows of `source`, rendered and fitted to the model's `context` once, as a stream."""
    rows = read_rows(source, tc.prompt_column, tc.columns)
    token_ids = render_prompts(tokenizer, rows, chat_template=tc.chat_template, system_prompt=tc.system_prompt,
                               tokenizer_dir=tokenizer_dir)
    token_ids, rows = fit_rows_to_context(token_ids, rows, context, tc.max_new_tokens, tc.long_prompts, source)
    return PromptStream(token_ids, seed=tc.seed, rows=rows)
