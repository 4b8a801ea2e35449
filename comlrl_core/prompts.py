"""Prompts as data: a per-agent template over a dataset item's fields, wrapped in the agent's chat template.

A run spec (JSON) cannot hold a Python formatter, and heterogeneous agents need their prompts in
different chat formats. A :class:`PromptTemplate` says what to ask; each agent's own tokenizer says
how its model expects to be asked.
"""

from __future__ import annotations

import string
from dataclasses import dataclass


def template_fields(template: str, what: str) -> list[str]:
    """The item fields ``template`` reads. Only plain names: attribute or index access (``{x.y}``,
    ``{x[0]}``) would let a template reach into objects, so it is refused."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"{what} {template!r} is not a valid template ({exc}); write fields as {{name}} "
                         "and a literal brace as {{{{ or }}}}.") from None
    fields = []
    for _, name, _, _ in parsed:
        if name is None:
            continue
        if not name.isidentifier():
            raise ValueError(f"{what} {template!r}: field {{{name}}} must be a plain item field name "
                             "(no positional, attribute or index fields).")
        fields.append(name)
    return fields


@dataclass(frozen=True)
class PromptTemplate:
    """One agent's prompt: ``user`` (and optional ``system``) are ``str.format`` templates over the
    item's fields, e.g. ``"Summarise: {article}"``. With ``chat`` (the default) the agent's tokenizer
    applies its chat template (system and user turns, then the assistant's opening); without it the
    formatted ``user`` text is the prompt as it is (base models, or a template that is complete).

    On later turns of a multi-turn run the ``external_transition``'s prompt replaces ``user``.
    """

    user: str
    system: str | None = None
    chat: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.user, str) or not self.user.strip():
            raise ValueError(f"PromptTemplate.user must be a non-empty template string, got {self.user!r}.")
        if self.system is not None and not isinstance(self.system, str):
            raise ValueError(f"PromptTemplate.system must be a template string or None, got {self.system!r}.")
        if not isinstance(self.chat, bool):
            raise ValueError(f"PromptTemplate.chat must be True or False, got {self.chat!r}.")
        template_fields(self.user, "PromptTemplate.user")
        if self.system is not None:
            template_fields(self.system, "PromptTemplate.system")

    @property
    def fields(self) -> list[str]:
        return template_fields(self.user, "user") + (template_fields(self.system, "system") if self.system else [])

    def check(self, item: dict, tokenizer, where: str) -> None:
        """Fail early, naming ``where``, when ``item`` lacks a field or the tokenizer has no chat template."""
        missing = [f for f in self.fields if f not in item]
        if missing:
            raise ValueError(f"{where}: the template reads {missing} but the dataset's items have only "
                             f"{sorted(item)}; use those fields or add them to the data.")
        if self.chat and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{where}: chat=True but the agent's tokenizer has no chat template (a base model?); "
                             "set chat: false to use the formatted text as the prompt, or give a chat model.")

    def render(self, item: dict, tokenizer, external_prompt: str | None = None) -> str:
        """The prompt text for ``item`` (the transition's ``external_prompt`` on later turns)."""
        user = external_prompt if external_prompt is not None else self.user.format_map(item)
        if not self.chat:
            return user
        messages = [{"role": "system", "content": self.system.format_map(item)}] if self.system else []
        messages.append({"role": "user", "content": user})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
