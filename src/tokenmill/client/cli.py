"""``tokenmill complete`` and ``tokenmill chat``: the client from a terminal.

Both stream tokens as they arrive. Errors print one line on stderr (the server's
message and the request id) and ``complete`` exits non-zero; ``chat`` stays open.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.client._sync import Client, Stream

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130
PROMPT = ">>> "


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", help="the gateway (default $TOKENMILL_URL or http://127.0.0.1:8000)"
    )
    parser.add_argument("--api-key", help="API key (default $TOKENMILL_API_KEY)")
    parser.add_argument("--model", help="model / deployment id (default: the server's first)")
    parser.add_argument("--max-tokens", type=int, help="most tokens to generate")
    parser.add_argument("--temperature", type=float, help="sampling temperature, 0 to 2")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    complete = subparsers.add_parser(
        "complete", help="stream a text completion of a prompt to stdout"
    )
    complete.add_argument("prompt", help="the prompt; '-' reads it from stdin")
    _add_common(complete)
    complete.set_defaults(func=complete_command)

    chat = subparsers.add_parser(
        "chat", help="interactive chat (Ctrl-C stops an answer, Ctrl-D leaves)"
    )
    chat.add_argument("--system", help="a system message that starts the conversation")
    _add_common(chat)
    chat.set_defaults(func=chat_command)


def _client(args: argparse.Namespace) -> Client:
    from tokenmill.client._sync import Client

    return Client(args.url, args.api_key)


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    return {"max_tokens": args.max_tokens, "temperature": args.temperature}


def _print_error(e: Exception) -> None:
    print(f"tokenmill: error: {e}", file=sys.stderr, flush=True)


def _write(stream: Stream) -> str:
    """Print each chunk as it arrives; return the text."""
    for chunk in stream:
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
    return stream.text


def complete_command(args: argparse.Namespace) -> int:
    from tokenmill.client.errors import TokenmillError

    prompt: str = sys.stdin.read() if args.prompt == "-" else args.prompt
    try:
        with _client(args) as client:
            stream = client.complete(prompt, model=args.model, stream=True, **_sampling(args))
            with stream:
                text = _write(stream)
    except TokenmillError as e:
        sys.stdout.flush()
        _print_error(e)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    if not text.endswith("\n"):
        print(flush=True)
    return 0


def chat_command(args: argparse.Namespace) -> int:
    from tokenmill.client.errors import TokenmillError

    with contextlib.suppress(ImportError):  # not on every platform
        import readline  # noqa: F401 - line editing and history for input()

    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("tokenmill chat: Ctrl-C stops an answer, Ctrl-D leaves.", flush=True)
    with _client(args) as client:
        while True:
            try:
                line = input(PROMPT)
            except EOFError:
                print(flush=True)
                return 0
            except KeyboardInterrupt:
                print(flush=True)  # like a shell: Ctrl-C at the prompt clears the line
                continue
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            stream = None
            try:
                stream = client.chat(history, model=args.model, stream=True, **_sampling(args))
                text = _write(stream)
                print(flush=True)
            except KeyboardInterrupt:
                # Keep what was shown, so the next turn follows on from it.
                text = stream.text if stream is not None else ""
                print("\n[interrupted]", flush=True)
            except TokenmillError as e:
                print(flush=True)
                _print_error(e)
                history.pop()  # the turn failed; let the user rephrase it
                continue
            finally:
                if stream is not None:
                    stream.close()
            if text:
                history.append({"role": "assistant", "content": text})
            else:
                history.pop()
