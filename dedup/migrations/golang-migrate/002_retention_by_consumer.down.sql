-- once dedup, back from version 2: the index on processed_at again.
CREATE INDEX IF NOT EXISTS "processed_events_processed_at_idx" ON "processed_events" (processed_at);
DROP INDEX IF EXISTS "processed_events_consumer_processed_at_idx";
