-- once dedup, back from version 5.
ALTER TABLE {{.Attempts}} DROP COLUMN IF EXISTS last_error;
