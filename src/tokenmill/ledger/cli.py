"""``tokenmill accounts|credits|keys|usage``: the admin API from the shell.

These talk to a running gateway over HTTP (``--url``, default ``$TOKENMILL_URL`` or
http://127.0.0.1:8000) with the admin key (``--admin-key`` or ``$TOKENMILL_ADMIN_KEY``),
so they work the same against SQLite or a shared PostgreSQL ledger.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def _client_args() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url",
        default=os.environ.get("TOKENMILL_URL", "http://127.0.0.1:8000"),
        help="the gateway (default $TOKENMILL_URL or http://127.0.0.1:8000)",
    )
    common.add_argument(
        "--admin-key",
        default=os.environ.get("TOKENMILL_ADMIN_KEY"),
        help="the admin key (default $TOKENMILL_ADMIN_KEY)",
    )
    return common


def _call(args: argparse.Namespace, method: str, path: str, body: Any = None) -> int:
    import httpx

    headers = {"authorization": f"Bearer {args.admin_key}"} if args.admin_key else {}
    try:
        resp = httpx.request(
            method, args.url.rstrip("/") + path, json=body, headers=headers, timeout=30.0
        )
    except httpx.HTTPError as e:
        print(f"tokenmill: cannot reach {args.url}: {e}", file=sys.stderr)
        return 1
    try:
        data = resp.json()
    except ValueError:
        data = {"error": {"message": resp.text}}
    if resp.status_code >= 400:
        message = data.get("error", {}).get("message", resp.text) if isinstance(data, dict) else ""
        print(f"tokenmill: {resp.status_code}: {message}", file=sys.stderr)
        return 1
    print(json.dumps(data, indent=2))
    return 0


def _accounts_create(args: argparse.Namespace) -> int:
    return _call(args, "POST", "/admin/accounts", {"name": args.name, "balance": args.balance})


def _accounts_show(args: argparse.Namespace) -> int:
    return _call(args, "GET", f"/admin/accounts/{args.account}")


def _credits_add(args: argparse.Namespace) -> int:
    return _call(args, "POST", f"/admin/accounts/{args.account}/credits", {"amount": args.amount})


def _keys_create(args: argparse.Namespace) -> int:
    body = {"account": args.account, "rpm": args.rpm, "tpm": args.tpm}
    return _call(args, "POST", "/admin/keys", body)


def _keys_revoke(args: argparse.Namespace) -> int:
    return _call(args, "DELETE", f"/admin/keys/{args.key_id}")


def _usage(args: argparse.Namespace) -> int:
    if args.request:
        return _call(args, "GET", f"/v1/usage/{args.request}")
    if not args.account:
        print("tokenmill usage: give an ACCOUNT or --request ID", file=sys.stderr)
        return 2
    return _call(args, "GET", f"/admin/accounts/{args.account}/usage?limit={args.limit}")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    common = _client_args()

    accounts = sub.add_parser("accounts", help="create and inspect accounts")
    acc_sub = accounts.add_subparsers(dest="accounts_command", required=True)
    create = acc_sub.add_parser("create", parents=[common], help="create an account")
    create.add_argument("name")
    create.add_argument("--balance", type=int, default=0, help="initial credit, micro-units")
    create.set_defaults(func=_accounts_create)
    show = acc_sub.add_parser("show", parents=[common], help="balance and open holds")
    show.add_argument("account")
    show.set_defaults(func=_accounts_show)

    credits = sub.add_parser("credits", help="add credit to an account")
    cred_sub = credits.add_subparsers(dest="credits_command", required=True)
    add = cred_sub.add_parser("add", parents=[common], help="add (or remove, if negative)")
    add.add_argument("account")
    add.add_argument("amount", type=int, help="micro-units (1 unit = 1,000,000)")
    add.set_defaults(func=_credits_add)

    keys = sub.add_parser("keys", help="create and revoke API keys")
    key_sub = keys.add_subparsers(dest="keys_command", required=True)
    kc = key_sub.add_parser("create", parents=[common], help="a new key; shown only once")
    kc.add_argument("account")
    kc.add_argument("--rpm", type=int, help="requests per minute")
    kc.add_argument("--tpm", type=int, help="tokens per minute (prompt + max_tokens in flight)")
    kc.set_defaults(func=_keys_create)
    kr = key_sub.add_parser("revoke", parents=[common], help="revoke a key by its id")
    kr.add_argument("key_id")
    kr.set_defaults(func=_keys_revoke)

    usage = sub.add_parser("usage", parents=[common], help="receipts of an account or request")
    usage.add_argument("account", nargs="?")
    usage.add_argument("--request", help="one request's receipt, by its x-request-id")
    usage.add_argument("--limit", type=int, default=20)
    usage.set_defaults(func=_usage)
