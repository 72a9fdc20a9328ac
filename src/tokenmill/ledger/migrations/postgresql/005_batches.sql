-- The Batch API (tokenmill.ledger.batches). ``files``: uploads and batch outputs,
-- owned by an account, their bytes in the row so that every gateway of the ledger
-- reads them; a row past ``expires`` is gone for readers and deleted by the sweeper.
CREATE TABLE files (
    id TEXT PRIMARY KEY,
    account_id TEXT NOT NULL REFERENCES accounts (id),
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created DOUBLE PRECISION NOT NULL,
    expires DOUBLE PRECISION NOT NULL,
    content BYTEA NOT NULL
);
CREATE INDEX files_account ON files (account_id, created);
CREATE INDEX files_expires ON files (expires);
-- A batch: its state and timestamps; ``body`` is the batch object's other fields
-- (metadata, errors) as JSON. ``deadline`` is created + the completion window.
CREATE TABLE batches (
    id TEXT PRIMARY KEY,
    account_id TEXT NOT NULL REFERENCES accounts (id),
    key_id TEXT,
    status TEXT NOT NULL,
    created DOUBLE PRECISION NOT NULL,
    deadline DOUBLE PRECISION NOT NULL,
    total INTEGER NOT NULL,
    body TEXT NOT NULL
);
CREATE INDEX batches_account ON batches (account_id, created);
CREATE INDEX batches_status ON batches (status);
-- One row a line of a batch's input: its progress and its result. ``state``:
-- pending, running (on ``gateway_id``, as ``request_id``), completed, failed.
-- A running line whose gateway stopped beating is taken back by another gateway.
CREATE TABLE batch_lines (
    batch_id TEXT NOT NULL REFERENCES batches (id) ON DELETE CASCADE,
    line INTEGER NOT NULL,
    custom_id TEXT NOT NULL,
    deployment TEXT NOT NULL,
    url TEXT NOT NULL,
    body TEXT NOT NULL,
    state TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    gateway_id TEXT,
    request_id TEXT,
    result TEXT,
    PRIMARY KEY (batch_id, line)
);
CREATE INDEX batch_lines_state ON batch_lines (state, deployment);
