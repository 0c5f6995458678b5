-- once dedup, back from version 4.
DROP TABLE IF EXISTS "processed_events_offsets";
