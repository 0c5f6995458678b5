package docs_test

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

var (
	link = regexp.MustCompile(`\]\(([^)\s]+)\)`)
	// inline is a code span: a link's syntax in it is code, not a link.
	inline  = regexp.MustCompile("`[^`\n]*`")
	heading = regexp.MustCompile(`(?m)^#{1,6}[ \t]+(.+?)[ \t]*$`)
	// notInSlug is what GitHub leaves out of a heading's anchor: all but
	// letters, digits, '_', '-' and spaces (which become '-').
	notInSlug = regexp.MustCompile(`[^\p{L}\p{N}_\- ]`)
)

// anchors returns the anchors GitHub gives the headings of a page: the
// heading lowercased, without punctuation, spaces as '-', a repeated one
// suffixed with -1, -2...
func anchors(text string) map[string]bool {
	out := map[string]bool{}
	seen := map[string]int{}
	for _, m := range heading.FindAllStringSubmatch(prose(text), -1) {
		slug := strings.ReplaceAll(notInSlug.ReplaceAllString(strings.ToLower(m[1]), ""), " ", "-")
		if n, ok := seen[slug]; ok {
			seen[slug] = n + 1
			out[slug+"-"+strconv.Itoa(n+1)] = true
			continue
		}
		seen[slug] = 0
		out[slug] = true
	}
	return out
}

// Every relative link of the README, the changelog and docs/*.md names a
// file of the repository, and a link to a heading of a page names one the
// page has: a section renamed or a file moved breaks no reader's link.
func TestLinksResolve(t *testing.T) {
	headings := map[string]map[string]bool{} // by file: each page's anchors, worked out once
	for _, page := range pages(t) {
		text := read(t, page)
		body := inline.ReplaceAllStringFunc(prose(text), func(code string) string {
			return strings.Repeat(" ", len(code))
		})
		for _, m := range link.FindAllStringSubmatchIndex(body, -1) {
			target := body[m[2]:m[3]]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			path, anchor, _ := strings.Cut(target, "#")
			file := page
			if path != "" {
				file = filepath.Join(filepath.Dir(page), path)
				if _, err := os.Stat(filepath.Join(root, file)); err != nil {
					t.Errorf("%s:%d: the link %q names no file", page, lineOf(body, m[0]), target)
					continue
				}
			}
			if anchor == "" || !strings.HasSuffix(file, ".md") {
				continue
			}
			if headings[file] == nil {
				headings[file] = anchors(read(t, file))
			}
			if !headings[file][anchor] {
				t.Errorf("%s:%d: the link %q names no heading of %s", page, lineOf(body, m[0]), target, file)
			}
		}
	}
}
