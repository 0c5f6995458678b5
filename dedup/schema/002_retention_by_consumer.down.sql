-- once dedup, back from version 2: the index on processed_at again.
CREATE INDEX IF NOT EXISTS {{.ProcessedAtIndex}} ON {{.Table}} (processed_at);
DROP INDEX IF EXISTS {{.ConsumerIndexQ}};
