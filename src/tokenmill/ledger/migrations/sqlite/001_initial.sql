-- Accounts, hashed API keys, open holds, receipts and per-key rate-limit windows.
-- Money is INTEGER micro-units; balance and held can never go below zero.
CREATE TABLE accounts (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    balance INTEGER NOT NULL DEFAULT 0 CHECK (balance >= 0),
    held INTEGER NOT NULL DEFAULT 0 CHECK (held >= 0),
    unlimited INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL
);
CREATE TABLE credits (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    account_id TEXT NOT NULL REFERENCES accounts (id),
    amount INTEGER NOT NULL,
    created REAL NOT NULL
);
CREATE TABLE api_keys (
    id TEXT PRIMARY KEY,
    account_id TEXT NOT NULL REFERENCES accounts (id),
    key_hash TEXT NOT NULL UNIQUE,
    rpm INTEGER,
    tpm INTEGER,
    created REAL NOT NULL,
    revoked REAL
);
CREATE TABLE gateways (
    id TEXT PRIMARY KEY,
    heartbeat REAL NOT NULL
);
CREATE TABLE holds (
    request_id TEXT PRIMARY KEY,
    account_id TEXT NOT NULL REFERENCES accounts (id),
    key_id TEXT,
    gateway_id TEXT NOT NULL,
    deployment TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    max_tokens INTEGER NOT NULL,
    amount INTEGER NOT NULL CHECK (amount >= 0),
    min_charge INTEGER NOT NULL,
    rate_window INTEGER NOT NULL,
    created REAL NOT NULL
);
CREATE INDEX holds_gateway ON holds (gateway_id);
CREATE INDEX holds_account ON holds (account_id);
CREATE TABLE receipts (
    request_id TEXT PRIMARY KEY,
    account_id TEXT NOT NULL REFERENCES accounts (id),
    key_id TEXT,
    deployment TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    held INTEGER NOT NULL,
    charged INTEGER NOT NULL CHECK (charged >= 0),
    finish_reason TEXT NOT NULL,
    created REAL NOT NULL,
    settled REAL NOT NULL
);
CREATE INDEX receipts_account ON receipts (account_id, settled);
CREATE TABLE rate_windows (
    key_id TEXT NOT NULL,
    rate_window INTEGER NOT NULL,
    requests INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    PRIMARY KEY (key_id, rate_window)
);
