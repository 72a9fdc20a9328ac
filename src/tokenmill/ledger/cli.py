"""``tokenmill accounts|credits|keys|usage|audit``: the admin API from the shell.

These talk to a running gateway over HTTP (``--url``, default ``$TOKENMILL_URL`` or
http://127.0.0.1:8000) with the admin key (``--admin-key`` or ``$TOKENMILL_ADMIN_KEY``),
so they work the same against SQLite or a shared PostgreSQL ledger.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, get_args
from urllib.parse import urlencode

from tokenmill.ledger.base import KeyPriority

PRIORITIES = get_args(KeyPriority)


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


def _budget(text: str) -> dict[str, Any]:
    """``AMOUNT/DURATION[@ZONE]`` (``2000000/24h@Europe/Paris``) as a budget window."""
    amount, _, rest = text.partition("/")
    duration, _, zone = rest.partition("@")
    if not amount.isdigit() or not duration:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give AMOUNT/DURATION[@ZONE], e.g. 2000000/24h@Europe/Paris"
        )
    return {"amount": int(amount), "duration": duration, "timezone": zone or "UTC"}


def _with_budget(body: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    if getattr(args, "no_budget", False):
        body["budget"] = []
    elif args.budget:
        body["budget"] = args.budget
    return body


def _accounts_create(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"name": args.name, "balance": args.balance}
    _with_budget(body, args)
    if args.weight is not None:
        body["weight"] = args.weight
    if args.max_concurrent is not None:
        body["max_concurrent"] = args.max_concurrent
    return _call(args, "POST", "/admin/accounts", body)


def _accounts_set(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {}
    if args.weight is not None:
        body["weight"] = args.weight
    if args.no_max_concurrent:
        body["max_concurrent"] = None
    elif args.max_concurrent is not None:
        body["max_concurrent"] = args.max_concurrent
    _with_budget(body, args)
    if not body:
        print("tokenmill accounts set: give --weight, --max-concurrent, --no-max-concurrent, "
              "--budget or --no-budget", file=sys.stderr)  # fmt: skip
        return 2
    return _call(args, "PATCH", f"/admin/accounts/{args.account}", body)


def _accounts_show(args: argparse.Namespace) -> int:
    return _call(args, "GET", f"/admin/accounts/{args.account}")


def _credits_add(args: argparse.Namespace) -> int:
    return _call(args, "POST", f"/admin/accounts/{args.account}/credits", {"amount": args.amount})


def _keys_create(args: argparse.Namespace) -> int:
    body = {"account": args.account, "rpm": args.rpm, "tpm": args.tpm, "priority": args.priority}
    return _call(args, "POST", "/admin/keys", _with_budget(body, args))


def _keys_set(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {} if args.priority is None else {"priority": args.priority}
    if not _with_budget(body, args):
        print("tokenmill keys set: give --priority, --budget or --no-budget", file=sys.stderr)
        return 2
    return _call(args, "PATCH", f"/admin/keys/{args.key_id}", body)


def _keys_show(args: argparse.Namespace) -> int:
    return _call(args, "GET", f"/admin/keys/{args.key_id}")


def _keys_revoke(args: argparse.Namespace) -> int:
    return _call(args, "DELETE", f"/admin/keys/{args.key_id}")


def _usage(args: argparse.Namespace) -> int:
    if args.request:
        return _call(args, "GET", f"/v1/usage/{args.request}")
    if not args.account:
        print("tokenmill usage: give an ACCOUNT or --request ID", file=sys.stderr)
        return 2
    return _call(args, "GET", f"/admin/accounts/{args.account}/usage?limit={args.limit}")


def _audit(args: argparse.Namespace) -> int:
    query: dict[str, Any] = {"limit": args.limit}
    for name in ("after", "actor", "action", "target", "since", "until"):
        value = getattr(args, name)
        if value is not None:
            query[name] = value
    return _call(args, "GET", "/admin/audit?" + urlencode(query))


def _budget_args(parser: argparse.ArgumentParser, *, removable: bool) -> None:
    parser.add_argument(
        "--budget",
        type=_budget,
        action="append",
        metavar="AMOUNT/DURATION[@ZONE]",
        help="a spend window, e.g. 2000000/24h@Europe/Paris (repeat for several; "
        "replaces the ones set)",
    )
    if removable:
        parser.add_argument("--no-budget", action="store_true", help="remove the budget")


def _scheduling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--weight", type=float, help="share of a busy deployment against other accounts (1)"
    )
    parser.add_argument(
        "--max-concurrent", type=int, help="streams it may run at once on one deployment"
    )


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    common = _client_args()

    accounts = sub.add_parser("accounts", help="create and inspect accounts")
    acc_sub = accounts.add_subparsers(dest="accounts_command", required=True)
    create = acc_sub.add_parser("create", parents=[common], help="create an account")
    create.add_argument("name")
    create.add_argument("--balance", type=int, default=0, help="initial credit, micro-units")
    _scheduling_args(create)
    _budget_args(create, removable=False)
    create.set_defaults(func=_accounts_create)
    change = acc_sub.add_parser("set", parents=[common], help="change weight or concurrency cap")
    change.add_argument("account")
    _scheduling_args(change)
    change.add_argument(
        "--no-max-concurrent", action="store_true", help="remove the concurrency cap"
    )
    _budget_args(change, removable=True)
    change.set_defaults(func=_accounts_set)
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
    kc.add_argument(
        "--priority",
        choices=PRIORITIES,
        default="default",
        help="the class of its requests and the highest they may ask for",
    )
    _budget_args(kc, removable=False)
    kc.set_defaults(func=_keys_create)
    ks = key_sub.add_parser("set", parents=[common], help="change a key's class or budget")
    ks.add_argument("key_id")
    ks.add_argument("--priority", choices=PRIORITIES)
    _budget_args(ks, removable=True)
    ks.set_defaults(func=_keys_set)
    kshow = key_sub.add_parser("show", parents=[common], help="a key's limits and budget")
    kshow.add_argument("key_id")
    kshow.set_defaults(func=_keys_show)
    kr = key_sub.add_parser("revoke", parents=[common], help="revoke a key by its id")
    kr.add_argument("key_id")
    kr.set_defaults(func=_keys_revoke)

    usage = sub.add_parser("usage", parents=[common], help="receipts of an account or request")
    usage.add_argument("account", nargs="?")
    usage.add_argument("--request", help="one request's receipt, by its x-request-id")
    usage.add_argument("--limit", type=int, default=20)
    usage.set_defaults(func=_usage)

    audit = sub.add_parser(
        "audit", parents=[common], help="the audit log of admin changes, newest first"
    )
    audit.add_argument("--actor", help="admin, key:<id> or system")
    audit.add_argument("--action", help="account.created, key.revoked, batch.cancelled, ...")
    audit.add_argument("--target", help="an account's, key's or batch's id")
    audit.add_argument("--since", type=float, help="at or after (seconds since the epoch)")
    audit.add_argument("--until", type=float, help="before (seconds since the epoch)")
    audit.add_argument("--after", type=int, help="the last id of the previous page")
    audit.add_argument("--limit", type=int, default=20)
    audit.set_defaults(func=_audit)
