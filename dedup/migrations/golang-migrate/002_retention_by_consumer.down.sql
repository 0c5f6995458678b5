-- once dedup, back from version 2: the index on processed_at again. The
-- retention index is dropped only if it is this table's (see the up step).
CREATE INDEX IF NOT EXISTS "processed_events_processed_at_idx" ON "processed_events" (processed_at);
-- +goose StatementBegin
DO $$
BEGIN
	IF EXISTS (SELECT 1 FROM pg_index WHERE indexrelid = to_regclass('"processed_events_consumer_processed_at_idx"') AND indrelid = to_regclass('"processed_events"')) THEN
		DROP INDEX "processed_events_consumer_processed_at_idx";
	END IF;
END $$;
-- +goose StatementEnd
