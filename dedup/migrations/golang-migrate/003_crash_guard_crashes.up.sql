-- once dedup, version 3: the consumer's crash guard keeps, beside the runs
-- of a message (attempts), how many of them were cut short by a crash of
-- the process while the message ran alone.
ALTER TABLE "processed_events_attempts" ADD COLUMN IF NOT EXISTS crashes integer NOT NULL DEFAULT 0;
