-- once dedup, back from version 1: removes the tables and every row in them.
DROP TABLE IF EXISTS "processed_events_attempts";
DROP TABLE IF EXISTS "processed_events";
