-- Fair share and priority classes (docs/fairness.md): an account's weight (its share
-- of a busy deployment) and the streams it may run at once on one deployment (NULL:
-- no cap); a key's priority class, the class of its requests and the highest they
-- may ask for.
ALTER TABLE accounts ADD COLUMN weight DOUBLE PRECISION NOT NULL DEFAULT 1 CHECK (weight > 0);
ALTER TABLE accounts ADD COLUMN max_concurrent BIGINT CHECK (max_concurrent >= 1);
ALTER TABLE api_keys ADD COLUMN priority TEXT NOT NULL DEFAULT 'default'
    CHECK (priority IN ('batch', 'default', 'interactive'));
