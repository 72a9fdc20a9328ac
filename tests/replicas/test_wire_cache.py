"""The replica frames carry cache-aware routing whole: a replica's published cache
(``kv_all``, ``kv``) and a request's prepared token ids decode to what was encoded."""

from __future__ import annotations

import json

from tokenmill.engines import ChatMessage, GenerationRequest, SamplingParams
from tokenmill.kvblocks import BlockSnapshot, BlockUpdate, CacheEvent, chain
from tokenmill.replicas.wire import (
    decode_cache_event,
    decode_request,
    encode_cache_event,
    encode_request,
)


def through_json(event: CacheEvent) -> CacheEvent:
    return decode_cache_event(json.loads(json.dumps(encode_cache_event(event))))


def test_cache_events_survive_the_wire() -> None:
    names = tuple(chain(list(range(64))))  # 64-bit names, some above 2**63
    snapshot = BlockSnapshot((names, (), names[:2]))
    assert through_json(snapshot) == snapshot
    with_parked = BlockSnapshot((names, (), names[:2]), n_slots=2)  # the last: parked
    assert through_json(with_parked) == with_parked
    update = BlockUpdate(2, 1, names[1:])
    assert through_json(update) == update
    # Lanes that are disk tier files, in a snapshot and as a lane is filled.
    with_disk = BlockSnapshot((names, (), names[:2], names[:1]), n_slots=2, disk=(3,))
    assert through_json(with_disk) == with_disk
    on_disk = BlockUpdate(3, 0, names, disk=True)
    assert through_json(on_disk) == on_disk


def test_prepared_token_ids_travel_with_the_request() -> None:
    request = GenerationRequest(
        request_id="r",
        sampling=SamplingParams(max_tokens=4),
        messages=(ChatMessage("user", "hi"),),
        tokenized=((1, 2, 3),),
    )
    back = decode_request(json.loads(json.dumps(encode_request(request))))
    assert back == request
    plain = GenerationRequest(request_id="r", sampling=SamplingParams(max_tokens=4), prompt="x")
    assert decode_request(json.loads(json.dumps(encode_request(plain)))) == plain
