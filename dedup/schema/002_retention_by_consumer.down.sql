-- once dedup, back from version 2: the index on processed_at again. The
-- retention index is dropped only if it is this table's (see the up step).
CREATE INDEX IF NOT EXISTS {{.ProcessedAtIndex}} ON {{.Table}} (processed_at);
-- +goose StatementBegin
DO $$
BEGIN
	IF EXISTS (SELECT 1 FROM pg_index WHERE indexrelid = to_regclass('{{.ConsumerIndexQ}}') AND indrelid = to_regclass('{{.Table}}')) THEN
		DROP INDEX {{.ConsumerIndexQ}};
	END IF;
END $$;
-- +goose StatementEnd
