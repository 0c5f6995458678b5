package conformance_test

import (
	"os"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/consumer/conformance"
	"github.com/onceco/once/consumer/memsource"
	"github.com/onceco/once/oncetest"
)

// newTestBroker stands for an adapter's own Broker: the honest one, on
// memsource, a fresh subscription per test.
func newTestBroker(*testing.T) conformance.Broker {
	return &memBroker{b: memsource.New(memsource.Options{Streams: 2, FallbackID: true})}
}

// TestConformance is the package doc's example as an adapter's own module
// writes it: with no package internal to this module, which it cannot
// import, the schema of each test from oncetest.Postgres.
func TestConformance(t *testing.T) {
	conformance.Run(t, conformance.Suite{
		Features:  conformance.Features{Ordered: true, FallbackID: true, RedeliverOnRestart: true},
		NewBroker: newTestBroker,
		NewDB:     func(t *testing.T) *pgxpool.Pool { return oncetest.Postgres(t) },
	})
}

// The package doc shows TestConformance as it is, so that its example
// compiles and passes: it named internal/pgtest, which an adapter's module
// cannot import.
func TestPackageDocShowsTheExample(t *testing.T) {
	doc, err := os.ReadFile("doc.go")
	require.NoError(t, err)
	code, err := os.ReadFile("example_test.go")
	require.NoError(t, err)
	body := string(code)
	body = body[strings.Index(body, "func TestConformance("):]
	body = body[:strings.Index(body, "\n}\n")+len("\n}")]
	var shown []string
	for _, line := range strings.Split(body, "\n") {
		shown = append(shown, "//\t"+line)
	}
	assert.Contains(t, string(doc), strings.Join(shown, "\n"), "consumer/conformance/doc.go must show TestConformance of example_test.go")
	assert.NotContains(t, string(doc), "internal/", "the doc's example imports no package internal to this module")
	assert.NotContains(t, string(doc), "pgtest.", "the doc's example imports no package internal to this module")
}
