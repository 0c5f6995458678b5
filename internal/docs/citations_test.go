package docs_test

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

var (
	testFunc = regexp.MustCompile(`(?m)^func ((?:Test|Example|Benchmark|Fuzz)\w*)\(`)
	cited    = regexp.MustCompile(`\b(?:Test|Example|Benchmark|Fuzz)[A-Z]\w*`)
)

// testNames returns the name of every test, example, benchmark and fuzz
// target of the repository's modules.
func testNames(t *testing.T) map[string]bool {
	t.Helper()
	names := map[string]bool{}
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == "testdata") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range testFunc.FindAllStringSubmatch(string(b), -1) {
			names[m[1]] = true
		}
		return nil
	})
	require.NoError(t, err)
	require.NotEmpty(t, names)
	return names
}

// packageDocs returns the doc.go files of the repository, relative to
// root.
func packageDocs(t *testing.T) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && d.Name() == ".git" {
			return filepath.SkipDir
		}
		if d.Name() == "doc.go" {
			rel, err := filepath.Rel(root, path)
			if err != nil {
				return err
			}
			out = append(out, rel)
		}
		return nil
	})
	require.NoError(t, err)
	return out
}

// The pages and package docs name the test behind each promise
// (docs/guarantees.md's last column, the failure matrix of
// docs/reliability.md): each test named exists, so that a test renamed or
// removed does not leave a promise that seems proved by nothing. The
// changelog is history, and may name tests that are gone.
func TestCitedTestsExist(t *testing.T) {
	names := testNames(t)
	for _, page := range append(pages(t), packageDocs(t)...) {
		if page == "CHANGELOG.md" {
			continue
		}
		text := read(t, page)
		for _, m := range cited.FindAllStringIndex(text, -1) {
			if strings.HasPrefix(text[m[1]:], "(") {
				continue // a -run or -bench pattern's prefix: BenchmarkOnce(PerMessage|Batched)
			}
			if name := text[m[0]:m[1]]; !names[name] {
				t.Errorf("%s:%d: %s is no test, example, benchmark or fuzz target of the repository", page, lineOf(text, m[0]), name)
			}
		}
	}
}
