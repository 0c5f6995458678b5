package bench

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// A freshly created PostgreSQL cluster has one or two WAL segments. Until
// its first checkpoints recycle old segments, every 16 MB of WAL is a new
// file that the backend needing it creates and fills with zeros
// (wal_init_zero) and syncs, holding the WAL write lock: every commit waits
// meanwhile. At the rates of the batched rows that is a stall of 30-50 ms
// about once a second, in every row alike (the hand-written one too), and
// it is what made the Kafka rows' p99 at half rate 45-70 ms in some runs
// and 14-20 ms in others on 2026-11-28: a server that has run a while
// renames segments it no longer needs into future ones at each checkpoint
// and creates none. warmWAL makes the throwaway server such a server before
// any row runs, so that the tails measure the consumer, not the cluster's
// first gigabyte (docs/performance.md, "A fresh cluster's WAL").

// walWarm is what warmWAL did, for the report.
type walWarm struct {
	// Made is the number of segments switched through.
	Made int `json:"wal_segments_made"`
	// Ready is the number of segments that existed ahead of the write
	// position afterwards: those the rows write into without creating one.
	Ready int `json:"wal_segments_ready"`
	// SegmentMB is the size of one segment.
	SegmentMB int `json:"wal_segment_mb"`
}

// warmWAL switches the server through segments WAL segments (0: as many as
// max_wal_size holds), then checkpoints, which recycles them into segments
// ahead of the write position. It needs a superuser (pg_switch_wal,
// CHECKPOINT): the throwaway server's. It writes segments × the segment size
// to the server's disk, about 2 s for 1 GB here.
func warmWAL(ctx context.Context, db *pgxpool.Pool, segments int) (walWarm, error) {
	var w walWarm
	conn, err := db.Acquire(ctx)
	if err != nil {
		return w, err
	}
	defer conn.Release()
	var segBytes, maxWALBytes int64
	if err := conn.QueryRow(ctx, `SELECT pg_size_bytes(current_setting('wal_segment_size')),
       pg_size_bytes(current_setting('max_wal_size'))`).Scan(&segBytes, &maxWALBytes); err != nil {
		return w, fmt.Errorf("WAL settings: %w", err)
	}
	w.SegmentMB = int(segBytes >> 20)
	if segments <= 0 {
		segments = int(maxWALBytes / segBytes)
	}
	// pg_switch_wal moves to the next segment only when something was
	// written since the last switch: one row before each.
	if _, err := conn.Exec(ctx, `CREATE TABLE IF NOT EXISTS oncebench_walwarm (n int)`); err != nil {
		return w, err
	}
	for range segments {
		if _, err := conn.Exec(ctx, `INSERT INTO oncebench_walwarm VALUES (1)`); err != nil {
			return w, err
		}
		if _, err := conn.Exec(ctx, `SELECT pg_switch_wal()`); err != nil {
			return w, fmt.Errorf("pg_switch_wal: %w", err)
		}
		w.Made++
	}
	if _, err := conn.Exec(ctx, `DROP TABLE oncebench_walwarm`); err != nil {
		return w, err
	}
	if _, err := conn.Exec(ctx, `CHECKPOINT`); err != nil {
		return w, fmt.Errorf("checkpoint: %w", err)
	}
	w.Ready, err = walSegmentsAhead(ctx, conn.Conn())
	return w, err
}

// walSegmentsAhead counts the WAL segment files beyond the one being
// written: those the server writes into without creating a file.
func walSegmentsAhead(ctx context.Context, conn *pgx.Conn) (int, error) {
	var n int
	err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_ls_waldir()
WHERE name ~ '^[0-9A-F]{24}$' AND name > pg_walfile_name(pg_current_wal_insert_lsn())`).Scan(&n)
	return n, err
}
