package docs_test

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// root is the repository's root, from this package's directory.
const root = "../.."

// pages returns the Markdown pages a user reads: the README, the
// changelog and docs/*.md, as paths relative to root.
func pages(t *testing.T) []string {
	t.Helper()
	docs, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	require.NoError(t, err)
	require.NotEmpty(t, docs)
	out := []string{"README.md", "CHANGELOG.md"}
	for _, d := range docs {
		rel, err := filepath.Rel(root, d)
		require.NoError(t, err)
		out = append(out, rel)
	}
	return out
}

// read returns the text of path, relative to root.
func read(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, path))
	require.NoError(t, err)
	return string(b)
}

var fence = regexp.MustCompile("(?ms)^[ \t]*```.*?^[ \t]*```")

// prose is text with its fenced code blocks blanked out (their lines kept,
// so that line numbers stay right): what is in them is not Markdown.
func prose(text string) string {
	return fence.ReplaceAllStringFunc(text, func(block string) string {
		return strings.Repeat("\n", strings.Count(block, "\n"))
	})
}

// lineOf is the 1-based line of offset in text.
func lineOf(text string, offset int) int { return strings.Count(text[:offset], "\n") + 1 }
