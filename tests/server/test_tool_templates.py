"""Tool calling with a chat template that knows tools (Hermes' markup), over HTTP
against the real model: the template renders the tools, its markup is read back."""

from __future__ import annotations

import httpx

from tests.server.test_tools import (
    CHAT,
    CONVERT,
    WEATHER,
    answer,
    ask,
    check_call,
    reassemble,
    stream,
)

# A chat template that knows tools (Hermes' markup, as Qwen's): SmolLM2's own with
# the tools, calls and results written the way Qwen 2.5's template writes them.
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments
within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' and message.tool_calls is defined %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}{% for tc in message.tool_calls %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% if not loop.last %}

{% endif %}{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}
"""


def test_a_template_that_knows_tools_renders_them_and_its_markup_is_read(
    http: httpx.Client,
) -> None:
    tools = [WEATHER, CONVERT]
    body = ask(
        "What is the weather in Kyoto?",
        tools=tools,
        tool_choice="required",
        chat_template=HERMES_TEMPLATE,
    )
    whole = answer(http, body)
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    for call in choice["message"]["tool_calls"]:
        check_call(call, tools)
    # Streamed, the markup is read as it comes into calls of the same shape. Not
    # compared token for token with the whole body: two greedy answers to this prompt
    # part at a near tie even on a KV stream a slot ({"unit": "celsius"} or not, by
    # where the cached prefix's cells sit), and the incremental reader is checked
    # against the whole-text reference for every split (test_toolcalls.py).
    got = reassemble(stream(http, body))
    assert got["finish_reason"] == "tool_calls" and got["message"]["content"] is None
    for call in got["message"]["tool_calls"]:
        check_call(call, tools)
    # The template wrote the tools into the prompt.
    bare = answer(http, {**body, "tools": None, "tool_choice": None, "max_tokens": 1})
    assert whole["usage"]["prompt_tokens"] > bare["usage"]["prompt_tokens"] + 50
    # A named function: one call of it, in the markup.
    named = {"type": "function", "function": {"name": "convert_currency"}}
    calls = answer(http, {**body, "tool_choice": named})["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["convert_currency"]
    check_call(calls[0], tools)


def test_a_template_that_knows_tools_renders_calls_and_results(http: httpx.Client) -> None:
    call = {
        "id": "call_k1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Kyoto"}'},
    }
    history = [
        {"role": "user", "content": "What is the weather in Kyoto?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_k1", "content": "light rain, 14 degrees"},
    ]
    body = ask("", tools=[WEATHER], chat_template=HERMES_TEMPLATE)
    first = answer(http, {**body, "messages": history[:1]})
    data = answer(http, {**body, "messages": history})
    choice = data["choices"][0]
    # auto: SmolLM2 writes no markup of its own, so it answers in text, and no tag
    # reaches the content.
    assert "<tool_call>" not in (choice["message"]["content"] or "")
    assert data["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"] + 20


def test_a_template_markup_and_a_response_format_are_not_both_asked(
    http: httpx.Client,
) -> None:
    body = ask("Hi", tools=[WEATHER], chat_template=HERMES_TEMPLATE)
    r = http.post(CHAT, json={**body, "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
