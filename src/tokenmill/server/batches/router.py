"""The Batch API's routes: ``/v1/files`` and ``/v1/batches``, as OpenAI's.

Thin: a request's files and batches are its account's (another account's read as
absent: 404), stored by :mod:`tokenmill.ledger.files` and
:mod:`tokenmill.ledger.batches`; a new batch's input file is
checked whole first (:mod:`~tokenmill.server.batches.lines`), and its lines run on
idle capacity (:mod:`~tokenmill.server.batches.runner`).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.datastructures import UploadFile
from starlette.responses import Response

from tokenmill.errors import InvalidRequestError, PayloadTooLargeError, ResourceNotFoundError
from tokenmill.identity import Caller
from tokenmill.ledger import BatchStore, FileStore
from tokenmill.server.auth import actor_of
from tokenmill.server.batches.lines import ENDPOINTS, check_file
from tokenmill.server.intake import parse_body, ready_gateway
from tokenmill.server.openapi import errors, json_body

router = APIRouter()

# The purposes a file may be uploaded for: a batch's input (outputs are the gateway's).
PURPOSES = ("batch",)
# completion_window: OpenAI takes "24h"; tokenmill takes any such span up to a week.
_WINDOW = re.compile(r"^([1-9][0-9]{0,6})([smh])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600}
MAX_WINDOW_S = 7 * 24 * 3600


def files_of(request: Request) -> FileStore:
    store: FileStore = request.app.state.files
    return store


def batches_of(request: Request) -> BatchStore:
    store: BatchStore = request.app.state.batches
    return store


def _account(request: Request) -> str:
    caller: Caller = request.state.caller
    return caller.account_id


def window_seconds(window: str) -> float:
    match = _WINDOW.match(window)
    seconds = 0 if match is None else int(match[1]) * _UNIT_S[match[2]]
    if not 0 < seconds <= MAX_WINDOW_S:
        raise InvalidRequestError(
            f'completion_window {window!r}: use "24h" (or a span such as "90m" or '
            f'"3600s", at most {MAX_WINDOW_S // 3600}h)',
            param="completion_window",
        )
    return seconds


# -- files ----------------------------------------------------------------------------
@router.post("/v1/files", responses=errors(400, 413))
async def create_file(request: Request) -> JSONResponse:
    limit: int = request.app.state.settings.files_max_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit + 64 * 1024:
        raise PayloadTooLargeError(f"the file is larger than the limit of {limit} bytes")
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise InvalidRequestError(
            "upload a file as multipart/form-data with the fields 'file' and 'purpose'"
        )
    async with request.form(max_files=1, max_fields=8) as form:
        purpose = form.get("purpose")
        upload = form.get("file")
        if not isinstance(purpose, str) or purpose not in PURPOSES:
            raise InvalidRequestError(
                f"purpose {purpose!r}: files are uploaded here for 'batch'", param="purpose"
            )
        if not isinstance(upload, UploadFile):
            raise InvalidRequestError("the form needs a 'file' part", param="file")
        content = await upload.read(limit + 1)
        if len(content) > limit:
            raise PayloadTooLargeError(f"the file is larger than the limit of {limit} bytes")
        name = (upload.filename or "upload.jsonl")[:255]
    stored = await files_of(request).put(_account(request), purpose, name, content)
    return JSONResponse(stored.to_json())


@router.get("/v1/files", responses=errors(400))
async def list_files(
    request: Request,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    after: str | None = None,
    order: Literal["asc", "desc"] = "desc",
) -> JSONResponse:
    page = await files_of(request).page(
        _account(request), purpose=purpose, limit=limit, after=after,
        newest_first=order == "desc",
    )  # fmt: skip
    data = [f.to_json() for f in page.data]
    return JSONResponse(_list(data, page.has_more))


def _list(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def _no_file(file_id: str) -> ResourceNotFoundError:
    return ResourceNotFoundError(f"no file {file_id!r}", param="file_id", code="file_not_found")


@router.get("/v1/files/{file_id}", responses=errors(404))
async def get_file(request: Request, file_id: str) -> JSONResponse:
    stored = await files_of(request).get(file_id, _account(request))
    if stored is None:
        raise _no_file(file_id)
    return JSONResponse(stored.to_json())


@router.get(
    "/v1/files/{file_id}/content",
    response_class=Response,
    responses={
        200: {"description": "The file's bytes", "content": {"application/octet-stream": {}}},
        **errors(404),
    },
)
async def file_content(request: Request, file_id: str) -> Response:
    content = await files_of(request).content(file_id, _account(request))
    if content is None:
        raise _no_file(file_id)
    return Response(content, media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}", responses=errors(404))
async def delete_file(request: Request, file_id: str) -> JSONResponse:
    if not await files_of(request).delete(file_id, _account(request)):
        raise _no_file(file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


# -- batches --------------------------------------------------------------------------
class BatchBody(BaseModel):
    """``POST /v1/batches``."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    # OpenAI's expiry of the output files; tokenmill keeps them files_retention_s.
    output_expires_after: dict[str, Any] | None = None


@router.post("/v1/batches", openapi_extra=json_body(BatchBody), responses=errors(400, 404, 413))
async def create_batch(request: Request) -> JSONResponse:
    body = await parse_body(request, BatchBody)
    if body.endpoint not in ENDPOINTS:
        raise InvalidRequestError(
            f"endpoint {body.endpoint!r}: a batch runs one of {', '.join(ENDPOINTS)}",
            param="endpoint",
        )
    window_s = window_seconds(body.completion_window)
    caller: Caller = request.state.caller
    files = files_of(request)
    stored = await files.get(body.input_file_id, caller.account_id)
    if stored is None:
        raise _no_file(body.input_file_id)
    if stored.purpose != "batch":
        raise InvalidRequestError(
            f"file {stored.id!r} was uploaded for {stored.purpose!r}, not 'batch'",
            param="input_file_id",
        )
    content = await files.content(stored.id, caller.account_id)
    if content is None:  # deleted meanwhile
        raise _no_file(body.input_file_id)
    settings = request.app.state.settings
    checked = check_file(content, body.endpoint, ready_gateway(request), settings.batch_max_lines)
    fields = {
        "endpoint": body.endpoint,
        "input_file_id": stored.id,
        "completion_window": body.completion_window,
        "metadata": body.metadata,
    }
    batch = await batches_of(request).create(
        caller.account_id, caller.key_id, fields, window_s, checked.lines, checked.report()
    )
    request.app.state.batch_runner.wake()
    return JSONResponse(batch.to_json())


def _no_batch(batch_id: str) -> ResourceNotFoundError:
    return ResourceNotFoundError(f"no batch {batch_id!r}", param="batch_id", code="batch_not_found")


@router.get("/v1/batches", responses=errors(400))
async def list_batches(
    request: Request,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: str | None = None,
) -> JSONResponse:
    page = await batches_of(request).page(_account(request), limit=limit, after=after)
    return JSONResponse(_list([b.to_json() for b in page.data], page.has_more))


@router.get("/v1/batches/{batch_id}", responses=errors(404))
async def get_batch(request: Request, batch_id: str) -> JSONResponse:
    batch = await batches_of(request).get(batch_id, _account(request))
    if batch is None:
        raise _no_batch(batch_id)
    return JSONResponse(batch.to_json())


@router.post("/v1/batches/{batch_id}/cancel", responses=errors(404))
async def cancel_batch(request: Request, batch_id: str) -> JSONResponse:
    actor = actor_of(request.state.caller, request.state.request_id)
    batch = await batches_of(request).cancel(batch_id, _account(request), actor=actor)
    if batch is None:
        raise _no_batch(batch_id)
    request.app.state.batch_runner.wake()
    return JSONResponse(batch.to_json())
