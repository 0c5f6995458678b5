package console_test

import (
	"html"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

// An event id of "*" alone (the empty prefix) and a search of blanks
// alone read as filters on the listing but selected every record, with
// an id or without. They are refused as once dlq refuses them.
func TestListingRefusesAFilterThatCannotNarrow(t *testing.T) {
	h := foreignDeadLetters(t, time.Now().Add(-time.Minute))
	for path, want := range map[string]string{
		"/dlq?q=0&id=*":                  `id "*": give a prefix before the * (a * alone selects every record, with an id or without)`,
		"/dlq?q=0&search=+":              `search " ": give text to look for (blanks alone are in nearly every record)`,
		"/dlq?q=0&consumer=billing&id=*": `id "*": give a prefix before the *`,
	} {
		code, body := serve(t, h, path)
		assert.Equal(t, http.StatusBadRequest, code, path)
		assert.Contains(t, html.UnescapeString(body), want, path)
	}
	assert.Equal(t, []string{"pay-1", "pay-2", "pay-3", "pay-4", "pay-5"}, listed(t, h, "/dlq?q=0&id=pay-*"))
	assert.Equal(t, []string{"pay-3"}, listed(t, h, "/dlq?q=0&search=PAY-3"))
}
