"""``/tokenize``, ``/detokenize``, ``/tokenizer_info`` and completions from token ids,
over HTTP.

One gateway holds every kind of deployment that can tokenize: llama.cpp in a replica
process (the default) and in the gateway's own process, an upstream proxy with a
``tokenizer`` and one without. The oracle for a token count is the engine's own
``usage.prompt_tokens`` for the same prompt.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jinja2
import openai
import pytest

from tests.conftest import ServerProcess, launch
from tests.server.test_bad_input import assert_error
from tokenmill.engines.embedded import embedded_model_path

PROMPT = "The three primary colours are"
ASK = [{"role": "user", "content": "Write one sentence about the sea."}]
# Nothing listens there: tokenizing an upstream deployment never calls it.
NOWHERE = "http://127.0.0.1:9/v1"
CONFIG = f"""
[[deployments]]
id = "smollm2"
max_num_seqs = 2
n_ctx = 1024
n_threads = 1

[[deployments]]
id = "inproc"
isolated = false
max_num_seqs = 1
n_ctx = 512
n_threads = 1

[[deployments]]
id = "counted"
engine = "upstream"
url = "{NOWHERE}"
tokenizer = "embedded"
n_ctx = 4096

[[deployments]]
id = "estimated"
engine = "upstream"
url = "{NOWHERE}"
"""
LLAMACPP = {"smollm2": 1024, "inproc": 512}


# The GGUF key that says the tokenizer adds a BOS token, as stored: its name, then its
# type (7: bool) and its value.
ADD_BOS = b"tokenizer.ggml.add_bos_token\x07\x00\x00\x00"


def bos_model(tmp: Path) -> Path:
    """SmolLM2 as a model whose tokenizer adds a BOS token (as Llama's does): the same
    file with its ``add_bos_token`` flag set (SmolLM2 adds none)."""
    src = embedded_model_path()
    with open(src, "rb") as f:
        head = f.read(1 << 20)  # the metadata comes first
    at = head.find(ADD_BOS)
    assert at > 0 and head[at + len(ADD_BOS)] == 0, "SmolLM2 stores add_bos_token = false"
    dst = tmp / "smollm2-bos.gguf"
    shutil.copyfile(src, dst)
    with open(dst, "r+b") as f:
        f.seek(at + len(ADD_BOS))
        f.write(b"\x01")
    return dst


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("tokenize")
    model = bos_model(tmp)
    config = f"""{CONFIG}
[[deployments]]
id = "bos"
model = "{model}"
max_num_seqs = 1
n_ctx = 256
n_threads = 1

[[deployments]]
id = "bos-counted"
engine = "upstream"
url = "{NOWHERE}"
tokenizer = "{model}"
"""
    srv = launch(tmp, config=config)
    yield srv
    srv.stop()


@pytest.fixture
def http(gw: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gw.url, timeout=60.0) as c:
        yield c


def ok(r: httpx.Response) -> Any:
    assert r.status_code == 200, r.text
    return r.json()


def prompt_tokens(http: httpx.Client, model: str, **body: Any) -> int:
    """The engine's own count: ``usage.prompt_tokens`` of a one-token generation."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    usage = ok(http.post(path, json={"model": model, "max_tokens": 1, **body}))["usage"]
    return int(usage["prompt_tokens"])


@pytest.mark.parametrize("model", list(LLAMACPP))
def test_tokenize_counts_what_a_generation_counts_and_detokenize_inverts_it(
    http: httpx.Client, model: str
) -> None:
    got = ok(http.post("/tokenize", json={"model": model, "prompt": PROMPT}))
    assert got["count"] == len(got["tokens"]) == prompt_tokens(http, model, prompt=PROMPT)
    assert got["max_model_len"] == LLAMACPP[model]
    assert ok(http.post("/detokenize", json={"model": model, "tokens": got["tokens"]})) == {
        "prompt": PROMPT
    }


@pytest.mark.parametrize("model", ["bos", "bos-counted"])
def test_add_special_tokens_false_leaves_out_the_bos_the_tokenizer_adds(
    http: httpx.Client, model: str
) -> None:
    bos = ok(http.get("/tokenizer_info", params={"model": model}))["bos_token"]
    bare = {"model": model, "prompt": bos, "add_special_tokens": False}
    (bos_id,) = ok(http.post("/tokenize", json=bare))["tokens"]
    for body in ({"prompt": PROMPT}, {"messages": ASK}):
        default = ok(http.post("/tokenize", json={"model": model, **body}))["tokens"]
        on = {"model": model, "add_special_tokens": True, **body}
        assert ok(http.post("/tokenize", json=on))["tokens"] == default
        off = {"model": model, "add_special_tokens": False, **body}
        assert default == [bos_id, *ok(http.post("/tokenize", json=off))["tokens"]]
    if model == "bos":  # the default is what a generation's prompt holds
        default = ok(http.post("/tokenize", json={"model": model, "prompt": PROMPT}))["tokens"]
        assert len(default) == prompt_tokens(http, model, prompt=PROMPT)


@pytest.mark.parametrize("model", list(LLAMACPP))
def test_add_special_tokens_changes_nothing_where_the_tokenizer_adds_nothing(
    http: httpx.Client, model: str
) -> None:
    for body in ({"prompt": PROMPT}, {"messages": ASK}):
        default = ok(http.post("/tokenize", json={"model": model, **body}))["tokens"]
        off = {"model": model, "add_special_tokens": False, **body}
        assert ok(http.post("/tokenize", json=off))["tokens"] == default


@pytest.mark.parametrize("model", list(LLAMACPP))
def test_tokenize_messages_renders_the_chat_template(http: httpx.Client, model: str) -> None:
    chat = ok(http.post("/tokenize", json={"model": model, "messages": ASK}))
    assert chat["count"] == prompt_tokens(http, model, messages=ASK)
    bare = ok(
        http.post(
            "/tokenize", json={"model": model, "messages": ASK, "add_generation_prompt": False}
        )
    )
    # Without the generation prompt: the same tokens, less the assistant turn's opening.
    assert 0 < bare["count"] < chat["count"]
    assert chat["tokens"][: bare["count"]] == bare["tokens"]
    text = ok(http.post("/detokenize", json={"model": model, "tokens": chat["tokens"]}))
    assert text["prompt"].endswith("assistant\n")
    assert ASK[0]["content"] in text["prompt"]


def test_an_upstream_tokenizes_with_its_tokenizer_or_says_it_has_none(
    http: httpx.Client,
) -> None:
    local = ok(http.post("/tokenize", json={"model": "smollm2", "messages": ASK}))
    counted = ok(http.post("/tokenize", json={"model": "counted", "messages": ASK}))
    assert counted == {**local, "max_model_len": 4096}
    text = ok(http.post("/detokenize", json={"model": "counted", "tokens": local["tokens"]}))
    assert text == ok(http.post("/detokenize", json={"model": "smollm2", **local}))

    for path, body in (("/tokenize", {"prompt": PROMPT}), ("/detokenize", {"tokens": [1]})):
        err = assert_error(http.post(path, json={"model": "estimated", **body}), 400)
        assert err["param"] == "model" and "tokenizer" in err["message"]


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_an_unknown_model_is_a_404(http: httpx.Client, path: str) -> None:
    body = {"model": "nope", "prompt": PROMPT, "tokens": [1]}
    err = assert_error(http.post(path, json=body), 404)
    assert err["param"] == "model"


# SmolLM2's special tokens; its end-of-sequence token is id 2.
EOS, BOS, EOS_ID = "<|im_end|>", "<|im_start|>", 2


@pytest.mark.parametrize("model", [*LLAMACPP, "counted"])
def test_tokenizer_info_is_what_lm_evals_remote_tokenizer_reads(
    http: httpx.Client, model: str
) -> None:
    info = ok(http.get("/tokenizer_info", params={"model": model}))
    assert info["eos_token"] == EOS and info["bos_token"] == BOS
    assert info["pad_token"] is None or isinstance(info["pad_token"], str)
    assert info["tokenizer_class"].startswith("llama.cpp")
    assert info["model_max_length"] == {**LLAMACPP, "counted": 4096}[model]
    # lm-eval's eos id: /tokenize of the eos token's text, the first id (one, here).
    body = {"model": model, "prompt": info["eos_token"], "add_special_tokens": False}
    assert ok(http.post("/tokenize", json=body))["tokens"] == [EOS_ID]
    assert ok(http.post("/detokenize", json={"model": model, "tokens": [EOS_ID]})) == {
        "prompt": EOS
    }
    # The model's own template, rendered as lm-eval renders it, is what a chat sees.
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    rendered = env.from_string(info["chat_template"]).render(
        messages=ASK, add_generation_prompt=True
    )
    chat = ok(http.post("/tokenize", json={"model": model, "messages": ASK}))
    text = ok(http.post("/detokenize", json={"model": model, "tokens": chat["tokens"]}))
    assert rendered == text["prompt"]


def test_tokenizer_info_without_a_tokenizer_or_a_model(http: httpx.Client) -> None:
    err = assert_error(http.get("/tokenizer_info", params={"model": "estimated"}), 400)
    assert err["param"] == "model" and "tokenizer" in err["message"]
    unknown = assert_error(http.get("/tokenizer_info", params={"model": "nope"}), 404)
    assert unknown["param"] == "model"
    # Several deployments and none named: 'model' is required, as for /tokenize.
    assert assert_error(http.get("/tokenizer_info"), 404)["param"] == "model"


@pytest.mark.parametrize("model", list(LLAMACPP))
@pytest.mark.parametrize("tokens", [[1, 49152], [1 << 40], [-1], [True], ["1"], 1, []])
def test_token_ids_outside_the_vocabulary_are_refused_by_name(
    http: httpx.Client, model: str, tokens: Any
) -> None:
    r = http.post("/detokenize", json={"model": model, "tokens": tokens})
    if tokens == []:
        assert ok(r) == {"prompt": ""}
        return
    assert assert_error(r, 400)["param"].startswith("tokens")


def test_tokenize_needs_exactly_one_of_prompt_and_messages(http: httpx.Client) -> None:
    assert_error(http.post("/tokenize", json={"model": "smollm2"}), 400)
    both = {"model": "smollm2", "prompt": PROMPT, "messages": ASK}
    assert_error(http.post("/tokenize", json=both), 400)


@pytest.mark.parametrize("model", list(LLAMACPP))
@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_of_token_ids_completes_as_its_text_does(
    gw: ServerProcess, http: httpx.Client, model: str, stream: bool
) -> None:
    tokens = ok(http.post("/tokenize", json={"model": model, "prompt": PROMPT}))["tokens"]
    client = openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0)

    def complete(prompt: str | list[int]) -> tuple[str, int]:
        args: dict[str, Any] = {"model": model, "max_tokens": 8, "temperature": 0}
        if not stream:
            r = client.completions.create(prompt=prompt, **args)
            assert r.usage is not None
            return r.choices[0].text, r.usage.prompt_tokens
        chunks = list(
            client.completions.create(
                prompt=prompt, stream=True, stream_options={"include_usage": True}, **args
            )
        )
        usage = chunks[-1].usage
        assert usage is not None
        return "".join(c.choices[0].text for c in chunks if c.choices), usage.prompt_tokens

    with client:
        text, n = complete(PROMPT)
        assert text and n == len(tokens)
        assert complete(tokens) == (text, n)


@pytest.mark.parametrize(
    "prompt",
    [[[1, 2], []], [[1, 49152]], ["a", [1]], [1, 49152], [1, -1], [1, True], []],
)
def test_bad_token_ids_are_refused_naming_prompt(http: httpx.Client, prompt: Any) -> None:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 1}
    assert assert_error(http.post("/v1/completions", json=body), 400)["param"].startswith("prompt")


def test_an_upstream_refuses_echo_by_name(http: httpx.Client) -> None:
    body = {"model": "estimated", "prompt": PROMPT, "max_tokens": 1, "echo": True}
    assert_error(http.post("/v1/completions", json=body), 400, "echo")


@pytest.mark.parametrize("model", list(LLAMACPP))
def test_echo_with_logprobs_in_either_kind_of_replica(http: httpx.Client, model: str) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    plain = ok(http.post("/v1/completions", json=body))["choices"][0]
    echoed = ok(http.post("/v1/completions", json={**body, "echo": True, "logprobs": 1}))
    choice = echoed["choices"][0]
    assert choice["text"] == PROMPT + plain["text"]
    n = ok(http.post("/tokenize", json={"model": model, "prompt": PROMPT}))["count"]
    logprobs = choice["logprobs"]["token_logprobs"]
    assert len(logprobs) == n + 3 and logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs[1:])
