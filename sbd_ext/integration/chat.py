"""A chat template for a model trained on one prompt format (``"Q: {prompt}\\nA: "``): what ``transformers serve``
and ``tokenizer.apply_chat_template`` need to turn OpenAI-style messages into the model's own prompt."""

from __future__ import annotations

__all__ = ["chat_template_for"]

_SLOT = "{prompt}"


def _jinja_literal(text: str) -> str:
    """``text`` as a Jinja string literal (no template syntax can leak out of it)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def chat_template_for(prompt_template: str, bos_token: bool = True) -> str:
    """A Jinja chat template that renders each user message as ``prompt_template`` filled with its content, each
    assistant message as its content followed by the EOS token, after the BOS token (``bos_token=False``: none, for
    a tokenizer that puts no BOS in front of encoded text, such as SmolLM2's). ``add_generation_prompt`` adds
    nothing: the template's text after ``{prompt}`` (``"\\nA: "``) already opens the answer. System messages and
    other roles are refused (the model was never trained on them) with an error naming the role."""
    if prompt_template.count(_SLOT) != 1:
        raise ValueError(f"prompt_template must contain {_SLOT!r} exactly once, got {prompt_template!r}")
    before, after = prompt_template.split(_SLOT)
    return (
        ("{{ bos_token }}" if bos_token else "") + "{% for message in messages %}"
        "{% if message['role'] == 'user' %}"
        f"{{{{ {_jinja_literal(before)} + message['content'] + {_jinja_literal(after)} }}}}"
        "{% elif message['role'] == 'assistant' %}"
        "{{ message['content'] + eos_token }}"
        "{% else %}"
        "{{ raise_exception('this model was trained on user and assistant turns only, got a ' + message['role'] "
        "+ ' message') }}"
        "{% endif %}"
        "{% endfor %}"
    )
