package docs_test

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// telemetryName is a metric, span or attribute name in the code: a
// string literal "once.…" or "messaging.…".
var telemetryName = regexp.MustCompile(`"((?:once|messaging)\.[a-z_.]+)"`)

// The metric, span attribute and instrument names the consumer, the
// adapters and the outbox relay emit are each on a page a user reads
// (docs/operations.md lists the consumer's, the adapters' and the outbox's
// pages their own), so that an alert or a dashboard can be written from
// the docs.
func TestTelemetryNamesAreDocumented(t *testing.T) {
	var docs strings.Builder
	for _, page := range []string{"docs/operations.md", "docs/kafka.md", "docs/amqp.md", "docs/outbox.md"} {
		docs.WriteString(read(t, page))
	}
	for _, dir := range []string{"consumer", "brokers", "outbox"} {
		err := filepath.WalkDir(filepath.Join(root, dir), func(path string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
				return err
			}
			src, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			for _, m := range telemetryName.FindAllStringSubmatch(string(src), -1) {
				assert.True(t, strings.Contains(docs.String(), "`"+m[1]+"`"), "%s emits %s, which no page names", path, m[1])
			}
			return nil
		})
		require.NoError(t, err)
	}
}
