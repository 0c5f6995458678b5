package testlog_test

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/onceco/once/internal/testlog"
)

// An ErrorLog keeps the records at level Error and above, with their
// attributes and those of Logger.With, and drops the others.
func TestErrorLogKeepsErrorsWithTheirAttributes(t *testing.T) {
	logs := &testlog.ErrorLog{}
	log := slog.New(logs)
	log.Info("started", "n", 1)
	log.Warn("broker unreachable", "err", errors.New("dial tcp: refused"))
	log.Error("the broker refuses the publisher", "err", errors.New("SASL refused"))
	log.With("group", "billing").WithGroup("g").With("topic", "orders").Error("fenced", "by", "other")
	log.Log(t.Context(), slog.LevelError+4, "above error")
	assert.Equal(t, []string{
		"the broker refuses the publisher err=SASL refused",
		"fenced group=billing topic=orders by=other",
		"above error",
	}, logs.Errors())
	assert.False(t, logs.Enabled(t.Context(), slog.LevelWarn), "records below Error are not even made")
}

// Records logged from many goroutines at once are all kept (and -race
// finds no race).
func TestErrorLogTakesConcurrentRecords(t *testing.T) {
	logs := &testlog.ErrorLog{}
	log := slog.New(logs).With("worker", "w")
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Go(func() {
			for j := range 50 {
				log.Error(fmt.Sprintf("e%d-%d", i, j))
				_ = logs.Errors()
			}
		})
	}
	wg.Wait()
	assert.Len(t, logs.Errors(), 8*50)
}
