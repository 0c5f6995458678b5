-- +goose Up
-- once dedup, version 5: the consumer's crash guard keeps, beside the runs
-- of a message, the failure of its last run (kind, error, stack, SQLSTATE as
-- JSON), so that a message whose runs were spent in a process that ended
-- before dead-lettering it is dead-lettered with that error.
-- A nullable column: code of version 4 runs on it.
-- once:additive
ALTER TABLE "processed_events_attempts" ADD COLUMN IF NOT EXISTS last_error jsonb;

-- +goose Down
-- once dedup, back from version 5.
ALTER TABLE "processed_events_attempts" DROP COLUMN IF EXISTS last_error;
