-- once: the transactional outbox. Rows are written by outbox.Add in the
-- producer's transaction and published by the relay. Idempotent.
CREATE TABLE IF NOT EXISTS {{.Table}} (
    seq         bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id    text        NOT NULL,
    topic       text        NOT NULL,
    routing_key text        NOT NULL DEFAULT '',
    key         bytea,
    type        text        NOT NULL DEFAULT '',
    headers     jsonb       NOT NULL DEFAULT '{}',
    trace       jsonb       NOT NULL DEFAULT '{}',
    body        bytea       NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    attempts    integer     NOT NULL DEFAULT 0,
    not_before  timestamptz,
    last_error  text,
    parked_at   timestamptz,
    sent_at     timestamptz
);

-- The relay's work: unsent rows in sequence order.
CREATE INDEX IF NOT EXISTS {{.PendingIndex}} ON {{.Table}} (seq)
    WHERE sent_at IS NULL AND parked_at IS NULL;

-- Per-key order: has the broker refused an earlier row of this key? Only
-- refused rows are in it, so it stays tiny and costs ordinary rows nothing.
CREATE INDEX IF NOT EXISTS {{.KeyIndex}} ON {{.Table}} (topic, key, seq)
    WHERE sent_at IS NULL AND (attempts > 0 OR parked_at IS NOT NULL);

-- Retention of rows kept after they were sent (RelayConfig.KeepSent).
CREATE INDEX IF NOT EXISTS {{.SentIndex}} ON {{.Table}} (sent_at)
    WHERE sent_at IS NOT NULL;

-- A notification per inserting statement wakes the relay at commit
-- (NOTIFY is transactional); rows inserted by plain SQL wake it too.
CREATE OR REPLACE FUNCTION {{.NotifyFunction}}() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('once_outbox_' || TG_RELID::text, '');
    RETURN NULL;
END
$$;

DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_trigger
                   WHERE tgrelid = '{{.Table}}'::regclass AND tgname = {{.NotifyTriggerLiteral}}) THEN
        CREATE TRIGGER {{.NotifyTrigger}} AFTER INSERT ON {{.Table}}
            FOR EACH STATEMENT EXECUTE FUNCTION {{.NotifyFunction}}();
    END IF;
END
$$;
