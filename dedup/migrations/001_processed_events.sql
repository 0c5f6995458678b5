-- +goose Up
-- once dedup, version 1: the processed-events and attempts tables.
CREATE TABLE IF NOT EXISTS "processed_events" (
    consumer     text        NOT NULL,
    event_id     text        NOT NULL,
    fingerprint  bytea,
    processed_at timestamptz NOT NULL DEFAULT now(),
    source       text        NOT NULL DEFAULT '',
    partition    integer,
    "offset"     bigint,
    PRIMARY KEY (consumer, event_id)
);

CREATE INDEX IF NOT EXISTS "processed_events_processed_at_idx" ON "processed_events" (processed_at);

CREATE TABLE IF NOT EXISTS "processed_events_attempts" (
    consumer  text        NOT NULL,
    event_id  text        NOT NULL,
    attempts  integer     NOT NULL,
    last_seen timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);

-- +goose Down
-- once dedup, back from version 1: removes the tables and every row in them.
DROP TABLE IF EXISTS "processed_events_attempts";
DROP TABLE IF EXISTS "processed_events";
