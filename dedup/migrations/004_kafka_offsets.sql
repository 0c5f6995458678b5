-- +goose Up
-- once dedup, version 4: a Kafka source with OffsetsInDatabase keeps each
-- partition's progress here, written in the transaction of the claims and
-- the handlers' effects: every offset below next_offset is done, and so
-- are the offsets in done (above it, finished out of order by key lanes).
-- epoch fences: each new owner of the partition raises it, and a write
-- with an older epoch changes nothing.
-- A table of its own: code of version 3 runs on it.
-- once:additive
CREATE TABLE IF NOT EXISTS "processed_events_offsets" (
	consumer    text        NOT NULL,
	topic       text        NOT NULL,
	partition   integer     NOT NULL,
	next_offset bigint      NOT NULL DEFAULT -1,
	done        bigint[]    NOT NULL DEFAULT '{}',
	epoch       bigint      NOT NULL DEFAULT 1,
	topic_id    text        NOT NULL DEFAULT '',
	kafka_group text        NOT NULL DEFAULT '',
	generation  integer     NOT NULL DEFAULT -1,
	updated_at  timestamptz NOT NULL DEFAULT now(),
	PRIMARY KEY (consumer, topic, partition)
);

-- +goose Down
-- once dedup, back from version 4.
DROP TABLE IF EXISTS "processed_events_offsets";
