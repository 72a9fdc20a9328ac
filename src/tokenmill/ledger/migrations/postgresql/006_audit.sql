-- The audit log (tokenmill.ledger.audit): one row per admin change, written in the
-- change's own transaction. ``actor``: admin, key:<id> or system; ``before_state``
-- and ``after_state``: the target as JSON before and after (NULL: it did not exist).
-- Append-only: the triggers refuse every UPDATE, DELETE and TRUNCATE.
CREATE TABLE audit_log (
    id BIGSERIAL PRIMARY KEY,
    at DOUBLE PRECISION NOT NULL,
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
CREATE FUNCTION audit_log_append_only() RETURNS trigger LANGUAGE plpgsql AS
$$ BEGIN RAISE EXCEPTION 'the audit log is append-only'; END $$;
CREATE TRIGGER audit_log_no_change BEFORE UPDATE OR DELETE ON audit_log
FOR EACH ROW EXECUTE FUNCTION audit_log_append_only();
CREATE TRIGGER audit_log_no_truncate BEFORE TRUNCATE ON audit_log
FOR EACH STATEMENT EXECUTE FUNCTION audit_log_append_only();
