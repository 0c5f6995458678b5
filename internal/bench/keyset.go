package bench

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// keysetRetentionSQL is the retention statement proposed for dedup, tried
// here on the bench's own table: the oldest $3 expired rows of a consumer
// from $4 on, in index order, so that each statement reads 5,000 entries
// of the (consumer, processed_at) index past where the last one stopped,
// instead of a sequential scan from the table's first page.
const keysetRetentionSQL = `WITH doomed AS (
	SELECT ctid FROM ` + scaleSchema + `.processed_events
	WHERE consumer = $1 AND processed_at < $2 AND processed_at >= $4
	ORDER BY processed_at LIMIT $3
), gone AS (
	DELETE FROM ` + scaleSchema + `.processed_events WHERE ctid = ANY(ARRAY(SELECT ctid FROM doomed))
	RETURNING processed_at
)
SELECT count(*), max(processed_at) FROM gone`

// Sweep is one retention sweep run while the row consumed.
type Sweep struct {
	Name string `json:"name"`
	// Cutoff is the age past which rows expired.
	Cutoff           string  `json:"cutoff"`
	RateDuring       float64 `json:"msgs_per_s_during"`
	Ratio            float64 `json:"ratio_to_without"`
	Deleted          int64   `json:"deleted"`
	DeletedDuringRow int64   `json:"deleted_during_row"`
	Seconds          float64 `json:"seconds"`
	DeletedPerSecond float64 `json:"deleted_per_s"`
	Statements       int     `json:"statements"`
	StatementP50Ms   float64 `json:"statement_p50_ms"`
	StatementMaxMs   float64 `json:"statement_max_ms"`
	LockWaitSamples  int     `json:"lock_wait_samples"`
	Samples          int     `json:"samples"`
	Correct          bool    `json:"correct"`
	Check            string  `json:"check"`
	Load             string  `json:"load"`
}

// keysetSweep runs the row once more while keysetRetentionSQL expires
// every consumer's rows older than cutoff (the row's consumer's first),
// for comparison with the library's retention on the same table.
func keysetSweep(ctx context.Context, db *pgxpool.Pool, kc *kafkaCluster, ro Options, row Row, age time.Duration, batch int, rateWithout float64) (*Sweep, error) {
	ro.scale.idPrefix += "k-"
	cutoff := time.Now().Add(-age)
	var deleted atomic.Int64
	var took []time.Duration
	sampleCtx, stopSampling := context.WithCancel(ctx)
	defer stopSampling()
	samples := make(chan lockSamples, 1)
	go func() { samples <- sampleLockWaits(sampleCtx, db) }()
	var sweepErr error
	var end time.Time
	var wg sync.WaitGroup
	start := time.Now()
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer stopSampling()
		for _, c := range scaleConsumers {
			if sweepErr = expireKeyset(ctx, db, c, cutoff, batch, &deleted, &took); sweepErr != nil {
				break
			}
		}
		end = time.Now()
	}()
	during, err := runRow(ctx, db, kc, ro, Kafka, row)
	s := &Sweep{Name: "keyset (proposed)", Cutoff: age.String(), DeletedDuringRow: deleted.Load()}
	wg.Wait()
	if err != nil {
		return nil, err
	}
	if sweepErr != nil {
		return nil, sweepErr
	}
	ls := <-samples
	slices.Sort(took)
	s.RateDuring, s.Ratio, s.Correct, s.Check = during.Rate, during.Rate/rateWithout, during.Correct, during.Check
	s.Deleted, s.Seconds = deleted.Load(), end.Sub(start).Seconds()
	s.DeletedPerSecond = float64(s.Deleted) / s.Seconds
	s.Statements, s.StatementP50Ms, s.StatementMaxMs = len(took), ms(percentile(took, 0.5)), ms(percentile(took, 1))
	s.LockWaitSamples, s.Samples, s.Load = ls.waiting, ls.samples, loadAvg()
	return s, nil
}

// expireKeyset deletes consumer's rows older than cutoff, batch rows per
// statement, each statement starting where the last one stopped.
func expireKeyset(ctx context.Context, db *pgxpool.Pool, consumer string, cutoff time.Time, batch int, deleted *atomic.Int64, took *[]time.Duration) error {
	from := pgtypeNegInfinity
	for {
		start := time.Now()
		var n int64
		var last *time.Time
		if err := db.QueryRow(ctx, keysetRetentionSQL, consumer, cutoff, batch, from).Scan(&n, &last); err != nil {
			return fmt.Errorf("keyset retention %s: %w", consumer, err)
		}
		*took = append(*took, time.Since(start))
		deleted.Add(n)
		if n < int64(batch) || last == nil {
			return nil
		}
		from = *last
	}
}

// pgtypeNegInfinity stands for -infinity: earlier than any processed_at.
var pgtypeNegInfinity = time.Date(1, 1, 1, 0, 0, 0, 0, time.UTC)
