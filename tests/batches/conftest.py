"""The Batch API's tests use the ledger's PostgreSQL schema fixture."""

from tests.ledger.conftest import pg_url

__all__ = ["pg_url"]
