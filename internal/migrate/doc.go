// Package migrate runs the numbered schema migrations of the module's
// components (the dedup store, and any other package with tables of its
// own) and records which ran.
//
// A component keeps its migrations as files NNN_name.up.sql and
// NNN_name.down.sql in an embedded fs.FS; Load reads them as text/template
// templates, so that schema and table names stay configurable, and checks
// that the versions run 1, 2, 3, … without a gap, each with both halves.
// A Series applies them: Migrate brings the component to the newest
// version and refuses a database whose recorded version is newer than the
// code knows (ErrNewer); MigrateTo moves it up or down to any version.
//
// Every component records its versions in one table, once_schema_versions
// (one row per applied migration, keyed by component and version), in the
// schema that holds the component's tables. A migration runs in one
// transaction, under a transaction-scoped advisory lock shared by every
// component, together with its version row: a schema is never left
// between two versions, and concurrent starts of many processes apply each
// migration once. A process waits for another's migration by trying the
// lock in short transactions of its own, so that its session's
// statement_timeout does not end the wait.
//
// A package with tables of its own embeds its series and builds it once:
//
//	//go:embed schema/*.sql
//	var schemaFiles embed.FS
//
//	sub, _ := fs.Sub(schemaFiles, "schema")
//	migs, err := migrate.Load(sub, names) // names: the quoted table names the templates use
//	series := &migrate.Series{Component: "outbox:" + table, Schema: schema,
//		Anchor: pgx.Identifier{table}.Sanitize(), Migrations: migs}
//	err = series.Migrate(ctx, pool)
//
// Anchor, with Schema "", keeps the versions beside the component's tables
// on the search_path; without it they go to the first version table the
// search_path finds, which may be another schema's.
//
// Adopt recognises tables created before the package recorded versions;
// Verify checks the tables' shape after the newest migration; Gone tells
// that a table of the recorded version was dropped by hand, which the up
// steps then make again (dedup uses all three).
package migrate
