"""Anthropic's context editing (``context_management.edits``) over a request's
messages: pure, the counting is the caller's.

* ``clear_tool_uses_20250919``: once the prompt passes the trigger (input tokens, or
  tool uses), the results of the oldest tool uses (all but the last ``keep``, none of
  ``exclude_tools``) are replaced by :data:`PLACEHOLDER`, and with
  ``clear_tool_inputs`` their calls' inputs by ``{}``: the model sees that something
  was there and is gone. Applied only when it clears at least ``clear_at_least``
  tokens (the caller measures that, :func:`clear_tool_uses` only edits).
* ``clear_thinking_20251015``: earlier answers' thinking blocks beyond the last
  ``keep`` turns. A model that does not reason never reads thinking blocks (they are
  dropped from every prompt, as Anthropic drops earlier turns' thinking), so clearing
  them changes no token: ``cleared_input_tokens`` is 0.

The client keeps its whole history; each request is edited afresh, so the same old
results are cleared again, and the prompt's cleared prefix stays the same from one
request to the next (the prefix cache keeps serving it).
"""

from __future__ import annotations

from typing import Any

from tokenmill.server.messages.protocol import (
    ClearThinking,
    ClearToolUses,
    InputMessage,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)

__all__ = ["PLACEHOLDER", "clear_thinking", "clear_tool_uses", "count_tool_uses"]

PLACEHOLDER = "[This tool result was cleared to save context.]"


def count_tool_uses(messages: list[InputMessage]) -> int:
    return sum(isinstance(b, ToolUseBlock) for m in messages for b in m.blocks())


def clear_tool_uses(
    messages: list[InputMessage], edit: ClearToolUses
) -> tuple[list[InputMessage], int]:
    """``messages`` with the oldest tool uses' results cleared, and how many uses
    were (the trigger is the caller's to check)."""
    uses = [b for m in messages for b in m.blocks() if isinstance(b, ToolUseBlock)]
    keep = edit.keep.value
    excluded = set(edit.exclude_tools or ())
    older = uses[: max(0, len(uses) - keep)]
    cleared = {u.id: u.name for u in older if u.name not in excluded}
    if not cleared:
        return messages, 0
    inputs = edit.clear_tool_inputs

    def clears_input(name: str) -> bool:
        return inputs is True or (isinstance(inputs, list) and name in inputs)

    out: list[InputMessage] = []
    for message in messages:
        if isinstance(message.content, str):
            out.append(message)
            continue
        blocks: list[Any] = []
        for block in message.content:
            if isinstance(block, ToolResultBlock) and block.tool_use_id in cleared:
                block = block.model_copy(update={"content": PLACEHOLDER})
            elif (
                isinstance(block, ToolUseBlock) and block.id in cleared and clears_input(block.name)
            ):
                block = block.model_copy(update={"input": {}})
            blocks.append(block)
        out.append(message.model_copy(update={"content": blocks}))
    return out, len(cleared)


def clear_thinking(
    messages: list[InputMessage], edit: ClearThinking
) -> tuple[list[InputMessage], int]:
    """``messages`` without the thinking of all but the last ``keep`` assistant turns
    that have some, and how many turns lost theirs."""
    thinking = [
        i
        for i, m in enumerate(messages)
        if m.role == "assistant" and any(isinstance(b, ThinkingBlock) for b in m.blocks())
    ]
    keep = edit.keep
    if keep == "all" or not hasattr(keep, "value"):  # "all", or {"type": "all"}
        return messages, 0
    value: int = keep.value
    cleared = thinking[: max(0, len(thinking) - value)]
    out = list(messages)
    for i in cleared:
        content = messages[i].content
        assert isinstance(content, list)  # it has blocks
        kept = [b for b in content if not isinstance(b, ThinkingBlock)]
        out[i] = messages[i].model_copy(update={"content": kept})
    return out, len(cleared)
