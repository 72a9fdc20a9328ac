"""How the ledger's tables read back as its records: the columns selected for an
account, a key (with its account's scheduling) and a receipt, and the record each
row becomes.

A column added by a migration is added here, in the list and in its record, in the
same change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenmill.ledger.base import Account, KeyInfo, Receipt

ACCOUNT_COLS = "id, name, balance, held, unlimited, created, weight, max_concurrent"
# A key with its account's scheduling: FROM KEY_JOIN.
KEY_COLS = (
    "k.id, k.account_id, k.rpm, k.tpm, k.created, k.revoked, k.priority, a.weight, a.max_concurrent"
)
KEY_JOIN = "api_keys k JOIN accounts a ON a.id = k.account_id"
RECEIPT_COLS = (
    "request_id, account_id, key_id, deployment, prompt_tokens, completion_tokens, "
    "held, charged, finish_reason, created, settled"
)


def account(row: Sequence[Any]) -> Account:
    return Account(
        row[0], row[1], int(row[2]), int(row[3]), bool(row[4]), float(row[5]),
        float(row[6]), None if row[7] is None else int(row[7]),
    )  # fmt: skip


def key(row: Sequence[Any]) -> KeyInfo:
    return KeyInfo(
        row[0], row[1], row[2], row[3], float(row[4]), row[5], row[6],
        float(row[7]), None if row[8] is None else int(row[8]),
    )  # fmt: skip


def receipt(row: Sequence[Any]) -> Receipt:
    return Receipt(
        row[0], row[1], row[2], row[3], int(row[4]), int(row[5]), int(row[6]), int(row[7]),
        row[8], float(row[9]), float(row[10]),
    )  # fmt: skip
