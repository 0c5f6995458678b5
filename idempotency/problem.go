package idempotency

import (
	"encoding/json"
	"net/http"
	"strconv"
)

// problem answers with an RFC 9457 problem details document, as the draft
// suggests for its error responses.
func problem(w http.ResponseWriter, status int, title, detail string) {
	body, _ := json.Marshal(struct {
		Type   string `json:"type"`
		Title  string `json:"title"`
		Status int    `json:"status"`
		Detail string `json:"detail"`
	}{"about:blank", title, status, detail})
	h := w.Header()
	h.Set("Content-Type", "application/problem+json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	if status == http.StatusConflict || status == http.StatusServiceUnavailable {
		// Both end: the request in flight finishes, the database returns.
		h.Set("Retry-After", "1")
	}
	w.WriteHeader(status)
	_, _ = w.Write(body)
}
