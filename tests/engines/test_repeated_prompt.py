"""A prompt asked again whole: the earlier answer is parked, and found there.

The slot caching the prompt is retaken, and what followed the prompt there (the
earlier answer) is copied to another slot first. The earlier exchange, continued, must
then find prompt and answer in that slot, with keys and values the model can read: its
reply repeats the list, which only the cached prefix holds.

(Parking after the first token instead, leaving the answer's cells in the retaken slot
for one decode, is refused by llama.cpp: a sequence's new positions must follow the
last one it holds.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from tests.conftest import ServerProcess
from tests.engines.test_batching import PREFIX
from tests.waiting import HANG_S

PROMPT = PREFIX + "Repeat the list: apple,"


def complete(url: str, body: dict[str, Any]) -> tuple[str, int, int]:
    r = httpx.post(url + "/v1/completions", json={"temperature": 0, **body}, timeout=HANG_S)
    assert r.status_code == 200, r.text
    out = r.json()
    usage = out["usage"]
    return (
        out["choices"][0]["text"],
        usage["prompt_tokens"],
        usage["prompt_tokens_details"]["cached_tokens"],
    )


def test_the_earlier_answer_is_found_parked(start_server: Callable[..., ServerProcess]) -> None:
    x = start_server(config='[[deployments]]\nid = "smollm2"\nmax_num_seqs = 4\n')
    answer, n_prompt, cached = complete(x.url, {"prompt": PROMPT, "max_tokens": 24})
    assert cached == 0
    assert answer.startswith(" river, candle, mountain"), answer

    # The same prompt again: all of it cached but the last token, in the slot that also
    # holds the answer; that answer is parked elsewhere.
    again, _, cached = complete(x.url, {"prompt": PROMPT, "max_tokens": 4, "seed": 3})
    assert cached == n_prompt - 1
    assert again.startswith(" river"), again

    # The first exchange continued: prompt and answer come from the park slot.
    follow = PROMPT + answer + "\nRepeat the list again: apple,"
    text, n_follow, cached = complete(x.url, {"prompt": follow, "max_tokens": 12})
    assert n_prompt + 12 < cached < n_follow
    assert text.startswith(" river, candle, mountain"), text
