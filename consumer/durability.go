package consumer

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// warnIfCommitsNotDurable logs a warning, once at start, when the
// settings of the pool's sessions let PostgreSQL acknowledge a COMMIT
// before it is on disk: synchronous_commit off (a crash then loses the
// commits of up to three times wal_writer_delay) or fsync off (a crash of
// the server's host may lose or corrupt any of them). The consumer acks a
// message once its transaction's COMMIT returns, so such a crash loses the
// effects of messages the broker no longer holds: the one promise the
// consumer cannot keep on its own. It warns instead of overriding the
// settings, which may be a deliberate trade (a test database, a stream
// that can be replayed); a setting it cannot read is not judged.
func (p *pipeline) warnIfCommitsNotDurable(ctx context.Context) {
	var syncCommit, fsync string
	err := p.pool.QueryRow(ctx, `SELECT current_setting('synchronous_commit'), current_setting('fsync')`).Scan(&syncCommit, &fsync)
	if err != nil {
		p.cfg.Telemetry.Logger.DebugContext(ctx, "once: cannot read synchronous_commit and fsync", "consumer", p.cfg.Name, "error", err)
		return
	}
	if syncCommit == "off" {
		p.cfg.Telemetry.Logger.WarnContext(ctx, "once: synchronous_commit is off for the consumer's sessions: PostgreSQL acknowledges a COMMIT "+
			"before it is on disk, and the consumer acks the message then, so a crash of the database loses the effects of the last "+
			"commits (up to three times wal_writer_delay) with their messages already acked; set synchronous_commit to on (or local) "+
			"for the consumer's role, database or pool (ConnConfig.RuntimeParams)",
			"consumer", p.cfg.Name, "synchronous_commit", syncCommit)
	}
	if fsync == "off" {
		p.cfg.Telemetry.Logger.WarnContext(ctx, "once: fsync is off on the database server: a crash of its host may lose any commit, "+
			"and with it the effects of messages already acked; turn fsync on",
			"consumer", p.cfg.Name, "fsync", fsync)
	}
}

// warnIfTablesUnlogged logs a warning for each of the store's tables, or
// of their partitions, that is UNLOGGED (made so by hand, for speed):
// PostgreSQL empties such a table after a crash, while the handlers' own
// tables keep what they committed. The processed events forgotten, their redeliveries are
// handled again and their effects doubled; Kafka offsets kept in the
// database forgotten, their partitions are read again from the group's
// offsets, and records without ids, deduplicated by those positions, are
// handled again.
func (p *pipeline) warnIfTablesUnlogged(ctx context.Context) {
	// Each table's partitions too: PostgreSQL empties an UNLOGGED
	// partition as it does an UNLOGGED table, and a partitioned table's
	// own persistence says nothing of them.
	rows, err := p.pool.Query(ctx, `SELECT c.oid::regclass::text FROM unnest($1::text[]) AS t JOIN pg_class c
	ON c.oid = to_regclass(t) OR c.oid IN (SELECT relid FROM pg_partition_tree(to_regclass(t)))
WHERE c.relpersistence = 'u' ORDER BY 1`,
		[]string{p.cfg.Store.ProcessedTable(), p.cfg.Store.AttemptsTable(), p.cfg.Store.OffsetsTable()})
	if err != nil {
		p.cfg.Telemetry.Logger.DebugContext(ctx, "once: cannot read whether the store's tables are logged", "consumer", p.cfg.Name, "error", err)
		return
	}
	unlogged, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		p.cfg.Telemetry.Logger.DebugContext(ctx, "once: cannot read whether the store's tables are logged", "consumer", p.cfg.Name, "error", err)
		return
	}
	for _, table := range unlogged {
		p.cfg.Telemetry.Logger.WarnContext(ctx, "once: a table of the store is UNLOGGED: PostgreSQL empties it after a crash while the handlers' "+
			"tables keep their effects, so the events it remembered are handled again when redelivered (and records deduplicated by "+
			"their Kafka position read again); ALTER TABLE ... SET LOGGED",
			"consumer", p.cfg.Name, "table", table)
	}
}
