"""A Qwen3-style chat template (Jinja) and its rendering with transformers' semantics.

The template is the one stored as `chat_template` in the bundled `tokenizer_config.json`:

    <|im_start|>user\\n{content}<|im_end|>\\n
    <|im_start|>assistant\\n<think>\\n{reasoning}\\n</think>\\n\\n{content}<|im_end|>\\n

Like Qwen3's, the generation prompt is `<|im_start|>assistant\\n`, and with
`enable_thinking=False` it is followed by an empty thinking segment `<think>\\n\\n</think>\\n\\n`.
The last assistant turn after the last user message keeps its reasoning (given as
`reasoning_content`, or inline in `content` before `</think>`); earlier assistant turns are
rendered without it. `render_chat` renders it in the one chat-template sandbox,
`clover_jax.text.chat_templates.render_chat_template` (transformers' semantics, with bounds on the
work a template does), so a tokenizer loaded with `AutoTokenizer.from_pretrained` renders the
same text (tested).
"""

from __future__ import annotations

from typing import Any

from clover_jax.text.chat_templates import render_chat_template

CHAT_TEMPLATE = """\
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_user = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('A system message must come first.') }}
        {%- endif %}
        {{- '<|im_start|>system\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content if message.content is string else '' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1] %}
        {%- endif %}
        {%- if loop.index0 > ns.last_user %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') + '<|im_end|>\\n' }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content.lstrip('\\n') + '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unsupported role ' + message.role + '; use system, user or assistant.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""  # noqa: E501 (one line per Jinja statement; the bundled tokenizer_config.json holds this exact text)


def render_chat(messages: list[dict[str, Any]], add_generation_prompt: bool = False,
                template: str = CHAT_TEMPLATE, **kwargs: Any) -> str:
    """The template's text for `messages` ({"role", "content"[, "reasoning_content"]} dicts);
    keyword arguments such as `enable_thinking` reach the template as variables."""
    return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt, **kwargs)
