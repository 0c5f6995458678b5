-- once dedup, version 2: retention deletes one consumer's rows at a time,
-- through an index on (consumer, processed_at) that replaces the one on
-- processed_at. On a large table, build the index beforehand with
-- CREATE INDEX CONCURRENTLY under the same name: this step then only drops
-- the old one. A build that did not finish leaves the index invalid, and
-- this step would take it for the index: check that pg_index.indisvalid
-- is true, or REINDEX it, first (Store.Migrate refuses it).
-- The old index is dropped only if it is this table's: index names are
-- per schema, and the name may be another store's index (the retention
-- index of a table "billing" is the old index name of "billing_consumer").
-- An index only: code of version 1 runs on it.
-- once:additive
CREATE INDEX IF NOT EXISTS {{.ConsumerIndex}} ON {{.Table}} (consumer, processed_at);
-- +goose StatementBegin
DO $$
BEGIN
	IF EXISTS (SELECT 1 FROM pg_index WHERE indexrelid = to_regclass('{{.ProcessedAtIndexQ}}') AND indrelid = to_regclass('{{.Table}}')) THEN
		DROP INDEX {{.ProcessedAtIndexQ}};
	END IF;
END $$;
-- +goose StatementEnd
