-- once dedup, version 1: the processed-events and attempts tables.
CREATE TABLE IF NOT EXISTS {{.Table}} (
    consumer     text        NOT NULL,
    event_id     text        NOT NULL,
    fingerprint  bytea,
    processed_at timestamptz NOT NULL DEFAULT now(),
    source       text        NOT NULL DEFAULT '',
    partition    integer,
    "offset"     bigint,
    PRIMARY KEY (consumer, event_id)
);

CREATE INDEX IF NOT EXISTS {{.ProcessedAtIndex}} ON {{.Table}} (processed_at);

CREATE TABLE IF NOT EXISTS {{.Attempts}} (
    consumer  text        NOT NULL,
    event_id  text        NOT NULL,
    attempts  integer     NOT NULL,
    last_seen timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);
