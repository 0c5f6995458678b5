-- once dedup, back from version 3.
ALTER TABLE "processed_events_attempts" DROP COLUMN IF EXISTS crashes;
