-- The audit log (tokenmill.ledger.audit): one row per admin change, written in the
-- change's own transaction. ``actor``: admin, key:<id> or system; ``before_state``
-- and ``after_state``: the target as JSON before and after (NULL: it did not exist).
-- Append-only: the triggers refuse every UPDATE and DELETE.
CREATE TABLE audit_log (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    actor TEXT NOT NULL,
    action TEXT NOT NULL,
    target_type TEXT NOT NULL,
    target_id TEXT NOT NULL,
    before_state TEXT,
    after_state TEXT,
    request_id TEXT,
    gateway_id TEXT NOT NULL
);
CREATE INDEX audit_log_target ON audit_log (target_id, id);
CREATE INDEX audit_log_actor ON audit_log (actor, id);
CREATE INDEX audit_log_action ON audit_log (action, id);
CREATE INDEX audit_log_at ON audit_log (at);
CREATE TRIGGER audit_log_no_update BEFORE UPDATE ON audit_log
BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;
CREATE TRIGGER audit_log_no_delete BEFORE DELETE ON audit_log
BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;
