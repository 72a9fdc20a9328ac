-- Stored responses of the Responses API (store = true), owned by the account that
-- made them. ``input_items`` is the whole conversation up to this response's input
-- (earlier turns included, as JSON items), ``body`` the response object as returned:
-- a conversation continues from one row, whichever gateway wrote it. A row past
-- ``expires`` (the retention period) is gone for readers and deleted by the sweeper.
CREATE TABLE responses (
    id TEXT PRIMARY KEY,
    account_id TEXT NOT NULL REFERENCES accounts (id),
    created REAL NOT NULL,
    expires REAL NOT NULL,
    input_items TEXT NOT NULL,
    body TEXT NOT NULL
);
CREATE INDEX responses_expires ON responses (expires);
