-- Accounts, hashed API keys, open holds, receipts and per-key rate-limit windows.
-- Money is BIGINT micro-units; balance and held can never go below zero.
CREATE TABLE accounts (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    balance BIGINT NOT NULL DEFAULT 0 CHECK (balance >= 0),
    held BIGINT NOT NULL DEFAULT 0 CHECK (held >= 0),
    unlimited BIGINT NOT NULL DEFAULT 0,
    created DOUBLE PRECISION NOT NULL
);
CREATE TABLE credits (
    id BIGSERIAL PRIMARY KEY,
    account_id TEXT NOT NULL REFERENCES accounts (id),
    amount BIGINT NOT NULL,
    created DOUBLE PRECISION NOT NULL
);
CREATE TABLE api_keys (
    id TEXT PRIMARY KEY,
    account_id TEXT NOT NULL REFERENCES accounts (id),
    key_hash TEXT NOT NULL UNIQUE,
    rpm BIGINT,
    tpm BIGINT,
    created DOUBLE PRECISION NOT NULL,
    revoked DOUBLE PRECISION
);
CREATE TABLE gateways (
    id TEXT PRIMARY KEY,
    heartbeat DOUBLE PRECISION NOT NULL
);
CREATE TABLE holds (
    request_id TEXT PRIMARY KEY,
    account_id TEXT NOT NULL REFERENCES accounts (id),
    key_id TEXT,
    gateway_id TEXT NOT NULL,
    deployment TEXT NOT NULL,
    prompt_tokens BIGINT NOT NULL,
    max_tokens BIGINT NOT NULL,
    amount BIGINT NOT NULL CHECK (amount >= 0),
    min_charge BIGINT NOT NULL,
    rate_window BIGINT NOT NULL,
    created DOUBLE PRECISION NOT NULL
);
CREATE INDEX holds_gateway ON holds (gateway_id);
CREATE INDEX holds_account ON holds (account_id);
CREATE TABLE receipts (
    request_id TEXT PRIMARY KEY,
    account_id TEXT NOT NULL REFERENCES accounts (id),
    key_id TEXT,
    deployment TEXT NOT NULL,
    prompt_tokens BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    held BIGINT NOT NULL,
    charged BIGINT NOT NULL CHECK (charged >= 0),
    finish_reason TEXT NOT NULL,
    created DOUBLE PRECISION NOT NULL,
    settled DOUBLE PRECISION NOT NULL
);
CREATE INDEX receipts_account ON receipts (account_id, settled);
CREATE TABLE rate_windows (
    key_id TEXT NOT NULL,
    rate_window BIGINT NOT NULL,
    requests BIGINT NOT NULL,
    tokens BIGINT NOT NULL,
    PRIMARY KEY (key_id, rate_window)
);
