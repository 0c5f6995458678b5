package outbox

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// ParkedRow is a row the relay gave up on: the broker rejected it
// RelayConfig.MaxAttempts times. Later rows of its (Topic, Key) wait until
// it is requeued or discarded.
type ParkedRow struct {
	// Seq identifies the row for Requeue and Discard.
	Seq     int64
	EventID string
	// Topic, RoutingKey and Key are the message's destination and key.
	Topic      string
	RoutingKey string
	Key        []byte
	// Attempts counts the broker's refusals; LastError is the last one.
	Attempts  int
	LastError string
	// CreatedAt is when the row was written, ParkedAt when it was parked.
	CreatedAt time.Time
	ParkedAt  time.Time
}

// Parked lists up to limit parked rows, oldest first (limit <= 0: all).
func (s *Store) Parked(ctx context.Context, db DB, limit int) ([]ParkedRow, error) {
	sql := `SELECT seq, event_id, topic, routing_key, key, attempts, coalesce(last_error, ''), created_at, parked_at
FROM ` + s.table + ` WHERE parked_at IS NOT NULL AND sent_at IS NULL ORDER BY seq`
	args := []any{}
	if limit > 0 {
		sql += ` LIMIT $1`
		args = append(args, limit)
	}
	rows, err := db.Query(ctx, sql, args...)
	if err != nil {
		return nil, fmt.Errorf("outbox: parked: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (ParkedRow, error) {
		var p ParkedRow
		err := row.Scan(&p.Seq, &p.EventID, &p.Topic, &p.RoutingKey, &p.Key, &p.Attempts, &p.LastError, &p.CreatedAt, &p.ParkedAt)
		return p, err
	})
	if err != nil {
		return nil, fmt.Errorf("outbox: parked: %w", err)
	}
	return out, nil
}

// Requeue gives parked rows back to the relay with their attempts reset
// (after the cause was fixed: the topic created, the binding added) and
// returns how many it found. Rows that are not parked are left alone.
func (s *Store) Requeue(ctx context.Context, db DB, seqs ...int64) (int64, error) {
	tag, err := db.Exec(ctx, `UPDATE `+s.table+` SET parked_at = NULL, attempts = 0, not_before = NULL
WHERE seq = ANY($1::bigint[]) AND parked_at IS NOT NULL AND sent_at IS NULL`, seqs)
	if err != nil {
		return 0, fmt.Errorf("outbox: requeue: %w", err)
	}
	return tag.RowsAffected(), nil
}

// Discard deletes parked rows, which are then never published, and returns
// how many it deleted; the rows of their keys behind them go on. Rows that
// are not parked are left alone.
func (s *Store) Discard(ctx context.Context, db DB, seqs ...int64) (int64, error) {
	tag, err := db.Exec(ctx, `DELETE FROM `+s.table+`
WHERE seq = ANY($1::bigint[]) AND parked_at IS NOT NULL AND sent_at IS NULL`, seqs)
	if err != nil {
		return 0, fmt.Errorf("outbox: discard: %w", err)
	}
	return tag.RowsAffected(), nil
}

// Status is a summary of the outbox for monitoring.
type Status struct {
	// Pending counts rows not yet published (parked ones excluded).
	Pending int64
	// Waiting counts the pending rows the relay has found waiting behind
	// a refused row of their key (it marks them at most once a second):
	// they are published once that row is sent, requeued or discarded.
	// Always 0 on a table of schema version 1.
	Waiting int64
	// Parked counts parked rows.
	Parked int64
	// Sent counts published rows still kept (RelayConfig.KeepSent).
	Sent int64
	// OldestPending is when the oldest pending row was written; zero when
	// none is pending. Its age is the relay's lag.
	OldestPending time.Time
}

// Status counts the outbox's rows by state.
func (s *Store) Status(ctx context.Context, db DB) (Status, error) {
	var st Status
	var oldest *time.Time
	const counts = `SELECT
	count(*) FILTER (WHERE sent_at IS NULL AND parked_at IS NULL),
	count(*) FILTER (WHERE sent_at IS NULL AND parked_at IS NOT NULL),
	count(*) FILTER (WHERE sent_at IS NOT NULL),
	min(created_at) FILTER (WHERE sent_at IS NULL AND parked_at IS NULL)`
	// A table of schema version 1 (its relay not upgraded yet) has no
	// waiting column, and no row marked waiting.
	var marks bool
	err := db.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_attribute
	WHERE attrelid = to_regclass($1) AND attname = 'waiting' AND NOT attisdropped)`, s.table).Scan(&marks)
	switch {
	case err != nil:
	case marks:
		err = db.QueryRow(ctx, counts+`,
	count(*) FILTER (WHERE sent_at IS NULL AND parked_at IS NULL AND waiting)
FROM `+s.table).Scan(&st.Pending, &st.Parked, &st.Sent, &oldest, &st.Waiting)
	default:
		err = db.QueryRow(ctx, counts+` FROM `+s.table).Scan(&st.Pending, &st.Parked, &st.Sent, &oldest)
	}
	if err != nil {
		return st, fmt.Errorf("outbox: status: %w", err)
	}
	if oldest != nil {
		st.OldestPending = *oldest
	}
	return st, nil
}
