-- How far each open hold's stream got, written by its gateway about once a second:
-- if that gateway dies, the sweeper charges these delivered tokens, not the prompt only.
-- streamed_charge is what the prompt and the streamed tokens cost (the gateway knows
-- the price; the ledger does not).
ALTER TABLE holds ADD COLUMN streamed BIGINT NOT NULL DEFAULT 0;
ALTER TABLE holds ADD COLUMN streamed_charge BIGINT NOT NULL DEFAULT 0;
