-- once dedup, back from version 5.
ALTER TABLE "processed_events_attempts" DROP COLUMN IF EXISTS last_error;
