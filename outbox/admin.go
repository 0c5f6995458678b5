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
	if err := s.made(); err != nil {
		return nil, err
	}
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
	if err := s.made(); err != nil {
		return 0, err
	}
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
	if err := s.made(); err != nil {
		return 0, err
	}
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
	// Backlog leaves it 0.
	Sent int64
	// OldestPending is when the oldest pending row was written; zero when
	// none is pending. Its age is the relay's lag.
	OldestPending time.Time
}

// Status counts the outbox's rows by state. Counting Sent reads every
// kept sent row (from their index when the planner finds that cheaper):
// with RelayConfig.KeepSent that is most of the table. To watch the
// relay's lag, call Backlog, which reads only the rows not yet sent.
func (s *Store) Status(ctx context.Context, db DB) (Status, error) {
	st, err := s.Backlog(ctx, db)
	if err != nil {
		return st, err
	}
	if err := db.QueryRow(ctx, `SELECT count(*) FROM `+s.table+` WHERE sent_at IS NOT NULL`).Scan(&st.Sent); err != nil {
		return st, fmt.Errorf("outbox: status: %w", err)
	}
	return st, nil
}

// Backlog is Status without Sent: the pending, waiting and parked rows and
// the oldest pending one's time. Each count reads the partial index of its
// state, never the whole table, so its cost follows the rows not yet sent,
// not the sent rows kept beside them (RelayConfig.KeepSent): call it as
// often as an alert on the relay's lag needs.
func (s *Store) Backlog(ctx context.Context, db DB) (Status, error) {
	if err := s.made(); err != nil {
		return Status{}, err
	}
	var st Status
	var oldestReady, oldestWaiting *time.Time
	// A table of schema version 1 (its relay not upgraded yet) has no
	// waiting column, and no row marked waiting: its pending rows are all
	// in the pending index of that version.
	var marks bool
	err := db.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_attribute
	WHERE attrelid = to_regclass($1) AND attname = 'waiting' AND NOT attisdropped)`, s.table).Scan(&marks)
	if err == nil {
		// Each condition is its index's predicate, or implies it, so that
		// the planner answers each count from that index.
		ready := `sent_at IS NULL AND parked_at IS NULL`
		waiting := `SELECT 0::bigint, NULL::timestamptz`
		if marks {
			ready += ` AND NOT waiting`
			waiting = `SELECT count(*), min(created_at) FROM ` + s.table + ` WHERE waiting AND sent_at IS NULL AND parked_at IS NULL`
		}
		err = db.QueryRow(ctx, `SELECT r.n, r.oldest, w.n, w.oldest,
	(SELECT count(*) FROM `+s.table+` WHERE sent_at IS NULL AND parked_at IS NOT NULL)
FROM (SELECT count(*) AS n, min(created_at) AS oldest FROM `+s.table+` WHERE `+ready+`) r,
	(`+waiting+`) w(n, oldest)`).Scan(&st.Pending, &oldestReady, &st.Waiting, &oldestWaiting, &st.Parked)
	}
	if err != nil {
		return st, fmt.Errorf("outbox: backlog: %w", err)
	}
	st.Pending += st.Waiting
	for _, t := range []*time.Time{oldestReady, oldestWaiting} {
		if t != nil && (st.OldestPending.IsZero() || t.Before(st.OldestPending)) {
			st.OldestPending = *t
		}
	}
	return st, nil
}
