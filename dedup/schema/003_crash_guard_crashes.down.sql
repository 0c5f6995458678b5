-- once dedup, back from version 3.
ALTER TABLE {{.Attempts}} DROP COLUMN IF EXISTS crashes;
