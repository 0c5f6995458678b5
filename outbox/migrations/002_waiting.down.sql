DROP TRIGGER IF EXISTS {{.ReleaseDeleteTrigger}} ON {{.Table}};
DROP TRIGGER IF EXISTS {{.ReleaseUpdateTrigger}} ON {{.Table}};
DROP FUNCTION IF EXISTS {{.ReleaseFunction}}();
DROP INDEX IF EXISTS {{.WaitingIndexQualified}};
CREATE INDEX IF NOT EXISTS {{.PendingIndex}} ON {{.Table}} (seq)
    WHERE sent_at IS NULL AND parked_at IS NULL;
DROP INDEX IF EXISTS {{.ReadyIndexQualified}};
ALTER TABLE {{.Table}} DROP COLUMN IF EXISTS waiting;
