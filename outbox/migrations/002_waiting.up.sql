-- once: rows waiting behind a refused row of their key leave the relay's
-- index of pending rows, so that its reads no longer pass over them.
-- once:additive
ALTER TABLE {{.Table}} ADD COLUMN IF NOT EXISTS waiting boolean NOT NULL DEFAULT false;

-- The relay's work: unsent rows in sequence order, but for the rows the
-- relay found waiting behind a refused row of their key (waiting). Those
-- cost each read a visit (and a look into the refused index) while the
-- refused row lasts: a key parked for an hour under a steady stream of
-- its rows slowed every key's publishing, without bound.
CREATE INDEX IF NOT EXISTS {{.ReadyIndex}} ON {{.Table}} (seq)
    WHERE sent_at IS NULL AND parked_at IS NULL AND NOT waiting;
DROP INDEX IF EXISTS {{.PendingIndexQualified}};

-- The rows a refused row's key holds waiting, found when it goes.
CREATE INDEX IF NOT EXISTS {{.WaitingIndex}} ON {{.Table}} (topic, key, seq)
    WHERE waiting;

-- A refused row that stops holding its key back (sent, requeued,
-- discarded; by the relay, an older release or plain SQL) gives the rows
-- waiting behind it back to the relay. Waiting is only where the relay
-- looks: its reads check each row's key order as before.
CREATE OR REPLACE FUNCTION {{.ReleaseFunction}}() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE {{.Table}} SET waiting = false
    WHERE waiting AND topic = OLD.topic AND key = OLD.key;
    RETURN NULL;
END
$$;

DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_trigger
                   WHERE tgrelid = '{{.Table}}'::regclass AND tgname = {{.ReleaseUpdateTriggerLiteral}}) THEN
        CREATE TRIGGER {{.ReleaseUpdateTrigger}} AFTER UPDATE ON {{.Table}} FOR EACH ROW
            WHEN (OLD.key IS NOT NULL AND OLD.sent_at IS NULL AND (OLD.attempts > 0 OR OLD.parked_at IS NOT NULL)
                AND NOT (NEW.sent_at IS NULL AND (NEW.attempts > 0 OR NEW.parked_at IS NOT NULL)))
            EXECUTE FUNCTION {{.ReleaseFunction}}();
    END IF;
    IF NOT EXISTS (SELECT FROM pg_trigger
                   WHERE tgrelid = '{{.Table}}'::regclass AND tgname = {{.ReleaseDeleteTriggerLiteral}}) THEN
        CREATE TRIGGER {{.ReleaseDeleteTrigger}} AFTER DELETE ON {{.Table}} FOR EACH ROW
            WHEN (OLD.key IS NOT NULL AND OLD.sent_at IS NULL AND (OLD.attempts > 0 OR OLD.parked_at IS NOT NULL))
            EXECUTE FUNCTION {{.ReleaseFunction}}();
    END IF;
END
$$;
