"""A Batch API input file checked line by line before anything runs.

Each line is ``{"custom_id", "method", "url", "body"}``; its body is read by the same
wire model, with the same messages, as the route it names would read it
(:func:`~tokenmill.server.intake.parse_json` into its :data:`ENDPOINTS` entry's
model, which the runner serves it through), and its ``model`` must name a
deployment. Every bad line is reported in OpenAI's ``errors`` object (``code``,
``message``, ``param``, ``line``, counted from 1) and a file with any is refused
whole: a batch with a bad line fails validation and runs nothing, so costs nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tokenmill.errors import ServiceError
from tokenmill.gateway import Gateway
from tokenmill.ledger.batches import LineSpec
from tokenmill.server.endpoint import Endpoint
from tokenmill.server.intake import parse_json
from tokenmill.server.openai.embeddings import EMBEDDINGS
from tokenmill.server.openai.serving import CHAT, COMPLETIONS
from tokenmill.server.responses.serving import RESPONSES

# The routes a batch's lines may call, by path: each one's wire model, union tags and
# serving function, which its route serves through too.
ENDPOINTS: dict[str, Endpoint[Any]] = {
    e.path: e for e in (CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES)
}
# Errors reported in full; past this many, one more says how many were left out.
MAX_ERRORS = 100


@dataclass(slots=True)
class Checked:
    lines: list[LineSpec] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    left_out: int = 0

    def error(self, line: int | None, code: str, message: str, param: str | None = None) -> None:
        if len(self.errors) >= MAX_ERRORS:
            self.left_out += 1
            return
        self.errors.append({"code": code, "message": message, "param": param, "line": line})

    def report(self) -> list[dict[str, Any]]:
        if not self.left_out:
            return self.errors
        more = {
            "code": "too_many_errors",
            "message": f"{self.left_out} more errors were left out of this list",
            "param": None,
            "line": None,
        }
        return [*self.errors, more]


def check_file(content: bytes, endpoint: str, gateway: Gateway, max_lines: int) -> Checked:
    """The lines of ``content`` for a batch on ``endpoint``, or why it cannot run."""
    checked = Checked()
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as e:
        checked.error(None, "invalid_file", f"the file is not UTF-8 text: {e}")
        return checked
    raw = [(i, line) for i, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if not raw:
        checked.error(None, "empty_file", "the file has no request lines")
        return checked
    if len(raw) > max_lines:
        checked.error(
            None,
            "too_many_lines",
            f"the file has {len(raw)} request lines; a batch takes at most {max_lines} "
            "(split it into several batches)",
        )
        return checked
    seen: dict[str, int] = {}
    for index, (number, line) in enumerate(raw):
        spec = _check_line(checked, number, line, endpoint, gateway)
        if spec is None:
            continue
        first = seen.setdefault(spec.custom_id, number)
        if first != number:
            checked.error(
                number,
                "duplicate_custom_id",
                f"custom_id {spec.custom_id!r} was already used on line {first}; "
                "each line needs its own",
                "custom_id",
            )
            continue
        checked.lines.append(LineSpec(index, spec.custom_id, spec.deployment, spec.url, spec.body))
    return checked


def _check_line(
    checked: Checked, number: int, line: str, endpoint: str, gateway: Gateway
) -> LineSpec | None:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        checked.error(number, "invalid_json_line", f"the line is not valid JSON: {e.msg}")
        return None
    if not isinstance(obj, dict):
        checked.error(number, "invalid_request", "each line must be a JSON object")
        return None
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        checked.error(number, "missing_required_parameter",
                      "each line needs a 'custom_id' string", "custom_id")  # fmt: skip
        return None
    method = obj.get("method")
    if method != "POST":
        checked.error(number, "invalid_method",
                      f"method {method!r}: batch lines are POST requests", "method")  # fmt: skip
        return None
    url = obj.get("url")
    if url != endpoint:
        checked.error(
            number,
            "invalid_url",
            f"url {url!r} is not the batch's endpoint {endpoint!r}: every line of a batch "
            "calls its endpoint",
            "url",
        )
        return None
    body = obj.get("body")
    if not isinstance(body, dict):
        checked.error(number, "invalid_request", "each line needs a 'body' object", "body")
        return None
    if body.get("stream"):
        checked.error(number, "invalid_request",
                      "a batch line cannot stream: leave 'stream' out", "body.stream")  # fmt: skip
        return None
    entry = ENDPOINTS[endpoint]
    try:
        parsed = parse_json(json.dumps(body), entry.model, entry.tags)
        deployment = gateway.deployment(getattr(parsed, "model", None))
    except ServiceError as e:
        param = f"body.{e.param}" if e.param else "body"
        checked.error(number, e.code or "invalid_request", e.message, param)
        return None
    return LineSpec(0, custom_id, deployment.id, url, body)
