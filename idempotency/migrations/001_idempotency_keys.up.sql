-- once: idempotency keys of HTTP commands (package idempotency).
-- Idempotent; safe to run on every start. Unqualified names: the table is
-- created in the first schema of the search_path, next to processed_events.
CREATE TABLE IF NOT EXISTS idempotency_keys (
    scope           text        NOT NULL,
    idempotency_key text        NOT NULL,
    fingerprint     bytea,
    method          text        NOT NULL DEFAULT '',
    path            text        NOT NULL DEFAULT '',
    -- 0 only inside the transaction that claimed the key: the response is
    -- written in the same transaction before it commits.
    status          integer     NOT NULL DEFAULT 0,
    header          jsonb       NOT NULL DEFAULT '{}',
    body            bytea       NOT NULL DEFAULT '',
    created_at      timestamptz NOT NULL DEFAULT now(),
    expires_at      timestamptz NOT NULL,
    PRIMARY KEY (scope, idempotency_key)
);

CREATE INDEX IF NOT EXISTS idempotency_keys_expires_at_idx ON idempotency_keys (expires_at);
