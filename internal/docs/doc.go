// Package docs holds no code: its tests keep the documentation true to the
// code. The Go examples of docs/*.md that no other test shows as they are
// compile here (snippets_test.go); every link between the Markdown pages
// resolves, anchors included (links_test.go); every test a page cites as
// the proof of a promise exists (citations_test.go); the Configuration
// tables of the adapters' and the HTTP middleware's pages have a row for
// every Config field (configtables_test.go); and every metric and span
// attribute name the library emits is on a page (telemetry_test.go).
package docs
