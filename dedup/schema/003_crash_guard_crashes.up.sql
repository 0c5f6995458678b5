-- once dedup, version 3: the consumer's crash guard keeps, beside the runs
-- of a message (attempts), how many of them were cut short by a crash of
-- the process while the message ran alone.
-- A column with a default: code of version 2 runs on it.
-- once:additive
ALTER TABLE {{.Attempts}} ADD COLUMN IF NOT EXISTS crashes integer NOT NULL DEFAULT 0;
