"""The Responses request's input items, validated without a server: an item of any
kind but the three tokenmill reads is refused, so a validated request's items are
always of those three (what ``ResponsesRequest.items`` relies on)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from tokenmill.server.refused import UNSUPPORTED
from tokenmill.server.responses.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ResponsesRequest,
    UnsupportedItem,
)

READ = ("message", "function_call", "function_call_output")
MESSAGE = {"role": "user", "content": "hi"}


@given(kind=st.text(max_size=30).filter(lambda k: k not in READ))
def test_any_other_item_is_refused(kind: str) -> None:
    with pytest.raises(ValidationError) as refused:
        ResponsesRequest.model_validate({"input": [MESSAGE, {"type": kind, "id": "x"}]})
    # (The other error is the union's other member: the input is not a string.)
    (error,) = [e for e in refused.value.errors() if e["type"] == UNSUPPORTED]
    assert error["loc"][-2:] == ("item:other", "type")
    assert repr(kind) in error["msg"]
    # Nor can one be made alone: its validator is the only way in.
    with pytest.raises(ValidationError):
        UnsupportedItem(type=kind)


def test_items_are_the_input_as_sent() -> None:
    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "call_1", "output": "1"}
    request = ResponsesRequest.model_validate({"input": [MESSAGE, call, output]})
    items = request.items()
    assert [type(i) for i in items] == [MessageItem, FunctionCallItem, FunctionCallOutputItem]
    assert items == request.input and items is not request.input
    (only,) = ResponsesRequest.model_validate({"input": "hi"}).items()
    assert isinstance(only, MessageItem) and (only.role, only.text()) == ("user", "hi")
