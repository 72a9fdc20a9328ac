-- Spend budgets that reset (tokenmill.ledger.budgets): one row a window of a key or
-- an account, ``amount`` micro-units each ``duration`` (30s, 24h, 7d, 1mo ...) on
-- calendar boundaries in ``timezone``. ``spent``: what the window starting at
-- ``window_start`` has charged or holds; a later window starts from 0.
CREATE TABLE budgets (
    owner_type TEXT NOT NULL CHECK (owner_type IN ('account', 'key')),
    owner_id TEXT NOT NULL,
    duration TEXT NOT NULL,
    amount BIGINT NOT NULL CHECK (amount >= 0),
    timezone TEXT NOT NULL,
    window_start DOUBLE PRECISION NOT NULL,
    spent BIGINT NOT NULL,
    PRIMARY KEY (owner_type, owner_id, duration)
);
-- The budget windows a hold was counted in (JSON), for its settlement to give back
-- what it did not charge.
ALTER TABLE holds ADD COLUMN budget_windows TEXT;
