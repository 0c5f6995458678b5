package outbox_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/pgtest"
	"github.com/onceco/once/outbox"
)

// A Store's doc says to build it with New, but a zero Store (or a nil one,
// a New whose error was dropped) used directly failed each call its own
// way: Migrate and SchemaSQL panicked on the nil migration series, Add
// said "cannot store statement description with empty SQL", and Status
// and the other administrative calls sent "SELECT ... FROM  WHERE", a
// syntax error that aborted the caller's transaction. Each fails before
// any statement with an error wrapping ErrStoreNotNew, naming outbox.New.
func TestStoreNotMadeByNewFailsClearly(t *testing.T) {
	pool, _ := pgtest.Schema(t)
	ctx := context.Background()
	for name, s := range map[string]*outbox.Store{"zero": {}, "nil": nil} {
		calls := map[string]func() error{
			"Migrate": func() error { return s.Migrate(ctx, pool) },
			"Check":   func() error { return s.Check(ctx, pool) },
			"Add":     func() error { return s.Add(ctx, pool, outbox.Message{Topic: "t"}) },
			"Statement": func() error {
				_, _, err := s.Statement(ctx, outbox.Message{Topic: "t"})
				return err
			},
			"Status":  func() error { _, err := s.Status(ctx, pool); return err },
			"Backlog": func() error { _, err := s.Backlog(ctx, pool); return err },
			"Parked":  func() error { _, err := s.Parked(ctx, pool, 0); return err },
			"Requeue": func() error { _, err := s.Requeue(ctx, pool, 1); return err },
			"Discard": func() error { _, err := s.Discard(ctx, pool, 1); return err },
		}
		for call, f := range calls {
			var err error
			require.NotPanics(t, func() { err = f() }, name+" "+call)
			require.ErrorIs(t, err, outbox.ErrStoreNotNew, name+" "+call)
			assert.Contains(t, err.Error(), "outbox.New", name+" "+call)
		}
		require.NotPanics(t, func() { assert.Empty(t, s.SchemaSQL(), name) }, name+" SchemaSQL")
		require.NotPanics(t, func() { assert.Empty(t, s.Table(), name) }, name+" Table")
	}
}
