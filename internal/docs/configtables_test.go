package docs_test

import (
	"reflect"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/brokers/kafka"
	"github.com/onceco/once/idempotency"
)

// tableNames returns the names in backquotes of the first column of the
// table under a page's "## Configuration" heading: `Brokers`,
// `FetchMin`, `DeadLetter.Topic`...
func tableNames(t *testing.T, page string) map[string]bool {
	t.Helper()
	text := read(t, page)
	start := strings.Index(text, "\n## Configuration\n")
	require.GreaterOrEqual(t, start, 0, "%s has no Configuration section", page)
	section := text[start+1:]
	if end := strings.Index(section[1:], "\n## "); end >= 0 {
		section = section[:end+1]
	}
	names := map[string]bool{}
	for _, line := range strings.Split(section, "\n") {
		cells := strings.Split(line, "|")
		if len(cells) < 3 || !strings.HasPrefix(line, "|") {
			continue
		}
		for _, m := range regexp.MustCompile("`([A-Za-z.]+)`").FindAllStringSubmatch(cells[1], -1) {
			names[m[1]] = true
		}
	}
	return names
}

// fieldNames returns the exported fields of a struct type, those of a
// nested struct (not a pointer) as Outer.Inner: the names a Config
// table's first column gives.
func fieldNames(typ reflect.Type) []string {
	var out []string
	for i := range typ.NumField() {
		f := typ.Field(i)
		if !f.IsExported() {
			continue
		}
		if f.Type.Kind() == reflect.Struct && f.Type.PkgPath() == typ.PkgPath() {
			for _, inner := range fieldNames(f.Type) {
				out = append(out, f.Name+"."+inner)
			}
			continue
		}
		out = append(out, f.Name)
	}
	return out
}

// The Configuration table of each adapter's page and of the HTTP
// middleware's has a row for every field of its Config, so that a reader
// who looks a setting up there finds its default: a field added to the
// code is added to the page.
func TestConfigTablesListEveryField(t *testing.T) {
	for page, cfg := range map[string]any{
		"docs/kafka.md": kafka.Config{},
		"docs/amqp.md":  amqp.Config{},
		"docs/http.md":  idempotency.Config{},
	} {
		rows := tableNames(t, page)
		for _, name := range fieldNames(reflect.TypeOf(cfg)) {
			assert.True(t, rows[name], "%s: the Configuration table has no row for %T's %s", page, cfg, name)
		}
	}
}
