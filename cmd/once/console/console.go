package console

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"errors"
	"fmt"
	"html/template"
	"log/slog"
	"net/http"
	"net/url"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceco/once/cmd/once/dlq"
	"github.com/onceco/once/cmd/once/inspect"
	"github.com/onceco/once/cmd/once/internal/field"
	"github.com/onceco/once/consumer"
)

// Config configures the console.
type Config struct {
	// DB is the database of the processed-events table; nil leaves the
	// consumers table out.
	DB *pgxpool.Pool
	// Tables names the tables; the zero value is the default names on the
	// search_path.
	Tables inspect.Tables
	// Queues are the dead-letter topics and queues shown. The console uses
	// them from concurrent requests.
	Queues []dlq.Queue
	// AllowReplay enables replays. Default false: read-only.
	AllowReplay bool
	// By is written in once-redriven-by on replays. Default "once console".
	By string
	// SuspectAge is the age past which an attempt row counts as a crash
	// suspect. Default 5 minutes.
	SuspectAge time.Duration
	// MaxRows is the number of records on one page of a listing; the
	// page links go to the others. Default 500.
	MaxRows int
	// Timeout bounds the broker and database work of one request, also
	// when a broker does not answer: the page then says so (504), and a
	// replay cut off stops (a queue of package dlq at once, another at
	// its next record) and logs its report.
	// Default 30 seconds.
	Timeout time.Duration
	// Logger receives replays and errors. Default slog.Default().
	Logger *slog.Logger
}

//go:embed templates/*.html
var templateFS embed.FS

// Handler serves the console. Build it with New.
type Handler struct {
	cfg  Config
	tmpl *template.Template
	mux  *http.ServeMux
	// busy holds a token while a request reads or replays the queue of
	// the same index.
	busy []chan struct{}
	// results keeps the outcomes of the latest replays, for their
	// result pages and for a form posted again.
	results results
}

// New validates cfg and returns the console's handler.
func New(cfg Config) (*Handler, error) {
	if cfg.DB == nil && len(cfg.Queues) == 0 {
		return nil, errors.New("console: Config needs a DB, Queues, or both")
	}
	for i, q := range cfg.Queues {
		if q == nil {
			return nil, fmt.Errorf("console: Config.Queues[%d] is nil", i)
		}
	}
	if cfg.By == "" {
		cfg.By = "once console"
	}
	if cfg.SuspectAge == 0 {
		cfg.SuspectAge = 5 * time.Minute
	}
	if cfg.MaxRows == 0 {
		cfg.MaxRows = 500
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 30 * time.Second
	}
	if cfg.SuspectAge < 0 || cfg.MaxRows < 0 || cfg.Timeout < 0 {
		return nil, errors.New("console: Config.SuspectAge, MaxRows and Timeout must not be negative")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	tmpl, err := template.New("").Funcs(funcs).ParseFS(templateFS, "templates/*.html")
	if err != nil {
		return nil, fmt.Errorf("console: templates: %w", err)
	}
	h := &Handler{cfg: cfg, tmpl: tmpl, mux: http.NewServeMux(), busy: make([]chan struct{}, len(cfg.Queues))}
	for i := range h.busy {
		h.busy[i] = make(chan struct{}, 1)
	}
	h.mux.HandleFunc("GET /{$}", h.overview)
	h.mux.HandleFunc("GET /dlq", h.list)
	h.mux.HandleFunc("GET /record", h.record)
	h.mux.HandleFunc("GET /payload", h.payload)
	h.mux.HandleFunc("GET /replayed", h.replayed)
	h.mux.Handle("POST /replay", http.NewCrossOriginProtection().Handler(http.HandlerFunc(h.replay)))
	return h, nil
}

// ServeHTTP serves the console's pages.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	h.mux.ServeHTTP(w, r)
}

var funcs = template.FuncMap{
	// time says its zone: a page read in a browser is read in the
	// reader's own time otherwise.
	"time": func(t time.Time) string {
		if t.IsZero() {
			return "-"
		}
		return t.UTC().Format("2006-01-02 15:04:05 UTC")
	},
	"ago":  ago,
	"text": shown,
	"dash": func(s string) string {
		if s == "" {
			return "-"
		}
		if s == "-" {
			// Not the "-" of no value: a consumer named "-" is not
			// the records without a consumer.
			return `"-"`
		}
		return shown(s)
	},
	"count": field.Count,
	// cut is the first field.Shown bytes of s as they are, for an
	// attribute.
	"cut": func(s string) string {
		b, _ := field.Cut([]byte(s))
		return string(b)
	},
	"clip": func(s string, n int) string {
		s = shown(strings.Join(strings.Fields(s), " "))
		if r := []rune(s); len(r) > n {
			return string(r[:n-1]) + "…"
		}
		return s
	},
}

// ago is how long before now t was. A time ahead of this clock (the
// consumer's or the database's clock ahead of the console's) says so
// rather than reading as a negative time ago.
func ago(t time.Time) string {
	if t.IsZero() {
		return ""
	}
	d := time.Since(t).Round(time.Second)
	if d < 0 {
		return (-d).String() + " ahead of this clock"
	}
	return d.String() + " ago"
}

// shown is text from a broker or the database as a page shows it: as it
// is when printable, else quoted with escapes, as the CLI prints it. HTML
// escaping keeps markup out; this keeps out what would change how the
// text reads (bidirectional controls that show an id reversed, control
// characters). Like a header on a record's page it is cut to its first
// field.Shown bytes, marked with its length: the event id, type, error or
// consumer of a record not written by this library may be as large as
// the record, and a listing shows them for each of its rows.
func shown(s string) string {
	c := clip([]byte(s), false)
	if c.Cut {
		c.Text += " … cut: the first " + field.Count(c.Shown) + " of its " + field.Count(c.Len) + " bytes are shown"
	}
	return c.Text
}

// page is what every template gets.
type page struct {
	Title       string
	AllowReplay bool
	Queues      []queueRef
	Error       string
	// Back, on an error page, is the listing the failed request was
	// asked from, "" when none.
	Back string
	Data any
}

type queueRef struct {
	Index int
	Name  string
}

// Tag names the queue in a replay form beside its Index: a digest of its
// name, which a browser posts back unchanged (it would rewrite the line
// breaks of a name given as it is).
func (r queueRef) Tag() string { return queueTag(r.Name) }

// queueTag is the tag of the queue named name.
func queueTag(name string) string {
	sum := sha256.Sum256([]byte(name))
	return hex.EncodeToString(sum[:8])
}

func (h *Handler) page(title string, data any) page {
	p := page{Title: title, AllowReplay: h.cfg.AllowReplay, Data: data}
	for i, q := range h.cfg.Queues {
		p.Queues = append(p.Queues, queueRef{i, q.Name()})
	}
	return p
}

func (h *Handler) render(w http.ResponseWriter, status int, name string, p page) {
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	if err := h.tmpl.ExecuteTemplate(w, name, p); err != nil {
		h.cfg.Logger.Error("once console: render", "page", name, "error", err)
	}
}

func (h *Handler) fail(w http.ResponseWriter, status int, err error) {
	h.failBack(w, status, err, "")
}

// failBack is fail with a link back to the listing back.
func (h *Handler) failBack(w http.ResponseWriter, status int, err error, back string) {
	h.cfg.Logger.Warn("once console: request failed", "error", err)
	p := h.page("Error", nil)
	p.Error, p.Back = err.Error(), back
	h.render(w, status, "error.html", p)
}

func (h *Handler) ctx(r *http.Request) (context.Context, context.CancelFunc) {
	return context.WithTimeout(r.Context(), h.cfg.Timeout)
}

// errTimeout is the error of broker work that did not end within
// Config.Timeout.
type errTimeout struct {
	queue string
	after time.Duration
	err   error
}

func (e *errTimeout) Error() string {
	return fmt.Sprintf("no answer from %s within %v (%v)", e.queue, e.after, e.err)
}

func (e *errTimeout) Unwrap() error { return e.err }

// brokerStatus is the status of a page whose broker work failed with err.
func brokerStatus(err error) int {
	var te *errTimeout
	if errors.As(err, &te) {
		return http.StatusGatewayTimeout
	}
	return http.StatusBadGateway
}

// use runs work on the queue at index i, one request's work at a time,
// and waits until it returns or ctx ends. One at a time: a RabbitMQ read
// takes the messages and puts them back, so two at once would each see
// part of the queue. Until ctx ends: the queues of package dlq return
// then, but a Queue that does not watch ctx must not hold the page; its
// work goes on in the background until it returns, and only then lets the
// next request at the queue.
func (h *Handler) use(ctx context.Context, i int, work func()) error {
	q := h.cfg.Queues[i]
	select {
	case h.busy[i] <- struct{}{}:
	case <-ctx.Done():
		return h.stopped(ctx, q)
	}
	done := make(chan struct{})
	var panicked error
	go func() {
		defer func() { <-h.busy[i] }()
		defer close(done)
		defer func() {
			// In a goroutine of its own no server recovers a panic:
			// it would end the process that serves the console.
			if p := recover(); p != nil {
				h.cfg.Logger.Error("once console: a queue panicked", "queue", q.Name(), "panic", p, "stack", string(debug.Stack()))
				panicked = fmt.Errorf("%s: panic: %v", q.Name(), p)
			}
		}()
		work()
	}()
	select {
	case <-done:
		return panicked
	case <-ctx.Done():
		select {
		case <-done:
			return panicked
		default:
			return h.stopped(ctx, q)
		}
	}
}

// collect is dlq.Collect on the queue at index i, through use.
func (h *Handler) collect(ctx context.Context, i int, f dlq.Filter) ([]*dlq.Record, error) {
	var recs []*dlq.Record
	err := h.browse(ctx, i, func(r *dlq.Record) {
		if f.Match(r) {
			recs = append(recs, r)
		}
	})
	return recs, err
}

// browse passes every record of the queue at index i to fn, through use:
// a page that shows part of a large queue keeps that part only.
func (h *Handler) browse(ctx context.Context, i int, fn func(*dlq.Record)) error {
	var err error
	if uerr := h.use(ctx, i, func() {
		err = h.cfg.Queues[i].Browse(ctx, func(r *dlq.Record) error {
			fn(r)
			return nil
		})
	}); uerr != nil {
		return uerr
	}
	if err != nil && ctx.Err() != nil {
		// The read returned as ctx ended (the queues of package dlq
		// close their connections then): it did not answer in time.
		return h.stopped(ctx, h.cfg.Queues[i])
	}
	return err
}

// stopped is the error of broker work on q that ctx ended.
func (h *Handler) stopped(ctx context.Context, q dlq.Queue) error {
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return &errTimeout{queue: q.Name(), after: h.cfg.Timeout, err: ctx.Err()}
	}
	return ctx.Err() // the client went away
}

// queueAt returns the queue of the request's q parameter.
func (h *Handler) queueAt(r *http.Request) (int, dlq.Queue, error) {
	i, err := strconv.Atoi(r.FormValue("q"))
	if err != nil || i < 0 || i >= len(h.cfg.Queues) {
		return 0, nil, fmt.Errorf("no dead-letter queue %q", r.FormValue("q"))
	}
	return i, h.cfg.Queues[i], nil
}

type overviewData struct {
	Consumers   []inspect.Consumer
	HasDB       bool
	DBFailed    string
	DeadLetters []queueSummary
}

type queueSummary struct {
	Queue  queueRef
	Kinds  []kindRow
	Total  int
	Failed string
}

// kindRow is a row of a queue's summary with the links to its records:
// those of its consumer, and those of its consumer and kind. A consumer
// or kind that is empty is asked for as none (noconsumer, nokind): an
// empty filter selects every record.
type kindRow struct {
	dlq.KindCount
	ByConsumer, ByKind string
}

func newKindRow(i int, c dlq.KindCount) kindRow {
	if c.Others {
		// The records of the pairs the tally does not keep: no filter
		// selects them alone, and "none" would select others.
		return kindRow{KindCount: c}
	}
	d := listData{Queue: queueRef{Index: i}, Filter: filterForm{
		Consumer: c.Consumer, NoConsumer: c.Consumer == "",
	}}
	r := kindRow{KindCount: c, ByConsumer: d.link(cursor{})}
	d.Filter.Kind, d.Filter.NoKind = c.Kind, c.Kind == ""
	r.ByKind = d.link(cursor{})
	return r
}

func (h *Handler) overview(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := h.ctx(r)
	defer cancel()
	d := overviewData{HasDB: h.cfg.DB != nil, DeadLetters: make([]queueSummary, len(h.cfg.Queues))}
	// The database and every queue at once, each within the whole
	// timeout: one that does not answer costs its own section only.
	var wg sync.WaitGroup
	if h.cfg.DB != nil {
		wg.Go(func() {
			cs, err := inspect.Consumers(ctx, h.cfg.DB, h.cfg.Tables, h.cfg.SuspectAge)
			if err != nil {
				// The dead letters are still worth showing.
				h.cfg.Logger.Warn("once console: read the consumers", "error", err)
				d.DBFailed = err.Error()
			}
			d.Consumers = cs
		})
	}
	for i, q := range h.cfg.Queues {
		wg.Go(func() {
			s := queueSummary{Queue: queueRef{i, q.Name()}}
			var kinds dlq.Tally
			total := 0
			err := h.browse(ctx, i, func(r *dlq.Record) {
				kinds.Add(r)
				total++
			})
			if err != nil {
				// What was read before the error is not the queue's
				// content: no count, no summary. (A read cut off by
				// the timeout may still be counting.)
				s.Failed = err.Error()
			} else {
				for _, c := range kinds.Counts() {
					s.Kinds = append(s.Kinds, newKindRow(i, c))
				}
				s.Total = total
			}
			d.DeadLetters[i] = s
		})
	}
	wg.Wait()
	h.render(w, http.StatusOK, "overview.html", h.page("Consumers", d))
}

type listData struct {
	Queue   queueRef
	Filter  filterForm
	Kinds   []string
	Records []row
	// Total is the number of records the filter selects.
	Total int
	// From and To are the 1-based places of the page's first and last
	// record among the Total, To < From on an empty page.
	From, To int
	// PastEnd is set on an empty page whose cursor has no record the
	// filter selects after (or before) it: records replayed or expired
	// since the link was made.
	PastEnd bool
	// Gone is the ref of the record the page's cursor names when the
	// read no longer has it (a RabbitMQ record replayed or removed since
	// the link was made), "" otherwise.
	Gone string
	// First, Prev, Next and Last link to those pages with the filter,
	// "" where there is none to go to; Self to this one.
	First, Prev, Next, Last, Self string
}

// cursor is where a page of a listing is: the first MaxRows records the
// filter selects after the record of ref After, or the last MaxRows before
// the record of ref Before, or the last MaxRows of all (Last); the zero
// cursor is the first page. A page is found by the record next to it, not
// by its number: records that arrive or go meanwhile elsewhere in the
// read do not shift it.
type cursor struct {
	After, Before string
	Last          bool
}

// cursorParam is the request's cursor: its after, before or last
// parameter, one at most.
func cursorParam(r *http.Request) (cursor, error) {
	c := cursor{After: r.FormValue("after"), Before: r.FormValue("before")}
	switch v := r.FormValue("last"); v {
	case "":
	case "1":
		c.Last = true
	default:
		return c, fmt.Errorf("last %q: want last=1", v)
	}
	n := 0
	for _, set := range []bool{c.After != "", c.Before != "", c.Last} {
		if set {
			n++
		}
	}
	if n > 1 {
		return c, errors.New("give one of after, before and last")
	}
	return c, nil
}

// marker finds the record of a cursor's ref in a read. A Kafka ref
// ("partition:offset") is compared by position, the partitions read in
// ascending order, so a record retention removed since still has its
// place; a RabbitMQ ref by the read, which has no position that outlives
// it: the records after the record of the ref are those read after it.
type marker struct {
	ref   string
	kafka bool
	part  int32
	off   int64
	seen  bool
}

func newMarker(ref string) *marker {
	m := &marker{ref: ref}
	if p, o, ok := strings.Cut(ref, ":"); ok {
		part, perr := strconv.ParseInt(p, 10, 32)
		off, oerr := strconv.ParseInt(o, 10, 64)
		if perr == nil && oerr == nil && part >= 0 && off >= 0 {
			m.kafka, m.part, m.off = true, int32(part), off
		}
	}
	return m
}

// place returns -1 when rec comes before the record of the ref in the
// read, 0 when it is that record, 1 when it comes after it. It is given
// the records in the order of the read.
func (m *marker) place(rec *dlq.Record) int {
	if m.kafka && rec.Partition >= 0 {
		m.seen = true // a Kafka position needs no record to be found
		switch {
		case rec.Partition < m.part || rec.Partition == m.part && rec.Offset < m.off:
			return -1
		case rec.Partition == m.part && rec.Offset == m.off:
			return 0
		}
		return 1
	}
	switch {
	case m.seen:
		// A message alike to the byte to the ref's (published twice)
		// has its ref: the first one read is the ref's record.
		return 1
	case rec.Ref == m.ref:
		m.seen = true
		return 0
	}
	return -1
}

// link is the path of the listing of the queue with the filter and the
// cursor.
func (d *listData) link(c cursor) string {
	var b strings.Builder
	b.WriteString("dlq?q=" + strconv.Itoa(d.Queue.Index))
	for _, f := range [][2]string{
		{"consumer", d.Filter.Consumer}, {"kind", d.Filter.Kind}, {"id", d.Filter.ID},
		{"search", d.Filter.Search}, {"since", d.Filter.Since},
		{"after", c.After}, {"before", c.Before},
	} {
		if f[1] != "" {
			b.WriteString("&" + f[0] + "=" + url.QueryEscape(f[1]))
		}
	}
	if d.Filter.NoConsumer {
		b.WriteString("&noconsumer=1")
	}
	if d.Filter.NoKind {
		b.WriteString("&nokind=1")
	}
	if c.Last {
		b.WriteString("&last=1")
	}
	return b.String()
}

// window keeps the last n records given to it, and counts those it let go.
type window struct {
	recs    []*dlq.Record
	next    int // where the next record goes once recs is full
	dropped int
	// lastDropped is the ref of the last record let go.
	lastDropped string
}

func (w *window) add(rec *dlq.Record, n int) {
	if len(w.recs) < n {
		w.recs = append(w.recs, rec)
		return
	}
	w.lastDropped = w.recs[w.next].Ref
	w.dropped++
	w.recs[w.next] = rec
	w.next = (w.next + 1) % n
}

// records returns the records kept, in the order given.
func (w *window) records() []*dlq.Record {
	return append(w.recs[w.next:len(w.recs):len(w.recs)], w.recs[:w.next]...)
}

type filterForm struct {
	Consumer, Kind, ID, Search, Since string
	// NoConsumer and NoKind select the records without a consumer or
	// without a kind (once-consumer, once-error-kind missing or empty):
	// an empty Consumer or Kind selects every record.
	NoConsumer, NoKind bool
}

type row struct {
	*dlq.Record
	Replayable    bool
	NotReplayable string
}

func toRow(r *dlq.Record) row {
	rw := row{Record: r, Replayable: true}
	if err := r.Replayable(false); err != nil {
		rw.Replayable, rw.NotReplayable = false, err.Error()
	}
	return rw
}

var allKinds = []string{
	string(consumer.KindDecode), string(consumer.KindHandler), string(consumer.KindPanic),
	string(consumer.KindUnknownType), string(consumer.KindMissingID), string(consumer.KindInvalidID),
	string(consumer.KindIDConflict), string(consumer.KindCrashLoop),
}

// filterOf returns the request's filter, as its form shows it and as
// the function that selects records.
// kindSet is the kinds a listing's drop-down offers: the kinds of this
// library, the filter's own, and the others met in the read (a record
// written by another version or another producer), so that each can be
// chosen, and a listing filtered by a kind the console does not know
// keeps its filter when the form is sent again.
type kindSet struct {
	list []string
}

// maxOtherKinds bounds the kinds met in a read that a drop-down offers: a
// topic written by other producers may have as many as records.
const maxOtherKinds = 32

func newKindSet(filter string) *kindSet {
	s := &kindSet{list: slices.Clone(allKinds)}
	if filter != "" && !slices.Contains(s.list, filter) {
		s.list = append(s.list, filter)
	}
	return s
}

// add offers kind, unless it is empty (the "none" box selects it), too
// long for an option, or past maxOtherKinds.
func (s *kindSet) add(kind string) {
	if kind == "" || len(kind) > field.Shown || len(s.list) >= len(allKinds)+maxOtherKinds || slices.Contains(s.list, kind) {
		return
	}
	s.list = append(s.list, kind)
}

func (h *Handler) filterOf(r *http.Request) (filterForm, func(*dlq.Record) bool, error) {
	ff := filterForm{
		Consumer: r.FormValue("consumer"), Kind: r.FormValue("kind"), ID: r.FormValue("id"),
		Search: r.FormValue("search"), Since: r.FormValue("since"),
	}
	var err error
	if ff.NoConsumer, err = flagParam(r, "noconsumer"); err != nil {
		return ff, nil, err
	}
	if ff.NoKind, err = flagParam(r, "nokind"); err != nil {
		return ff, nil, err
	}
	if ff.NoConsumer && ff.Consumer != "" || ff.NoKind && ff.Kind != "" {
		return ff, nil, errors.New("give a consumer or noconsumer=1 (no consumer), a kind or nokind=1 (no kind), not both")
	}
	f := dlq.Filter{Consumer: ff.Consumer, EventID: ff.ID, Search: ff.Search}
	if err := f.Check(); err != nil {
		// Refused as once dlq refuses it: a listing of every record
		// under a filter that reads as narrowing.
		return ff, nil, err
	}
	switch {
	case ff.Kind != "":
		f.Kinds = []string{ff.Kind}
	case ff.NoKind:
		f.Kinds = []string{""}
	}
	if ff.Since != "" {
		d, err := time.ParseDuration(ff.Since)
		if err != nil || d < 0 {
			return ff, nil, fmt.Errorf("since %q: want a duration such as 2h", ff.Since)
		}
		f.Since = time.Now().Add(-d)
	}
	// dlq.Filter takes an empty Consumer for any: none is selected here.
	return ff, func(rec *dlq.Record) bool {
		return f.Match(rec) && (!ff.NoConsumer || rec.Consumer() == "")
	}, nil
}

// flagParam is the request's parameter name, "" (unset) or "1" (set).
func flagParam(r *http.Request, name string) (bool, error) {
	switch v := r.FormValue(name); v {
	case "":
		return false, nil
	case "1":
		return true, nil
	default:
		return false, fmt.Errorf("%s %q: want %s=1", name, v, name)
	}
}

func (h *Handler) list(w http.ResponseWriter, r *http.Request) {
	i, q, err := h.queueAt(r)
	if err != nil {
		h.fail(w, http.StatusNotFound, err)
		return
	}
	ff, match, err := h.filterOf(r)
	if err != nil {
		h.fail(w, http.StatusBadRequest, err)
		return
	}
	cur, err := cursorParam(r)
	if err != nil {
		h.fail(w, http.StatusBadRequest, err)
		return
	}
	ctx, cancel := h.ctx(r)
	defer cancel()
	d := listData{Queue: queueRef{i, q.Name()}, Filter: ff}
	kinds := newKindSet(ff.Kind)
	size := h.cfg.MaxRows
	// The page's records are kept, the others counted: before is the
	// number of matches read before the page, prev the ref of the last
	// of them.
	var (
		page   []*dlq.Record
		before int
		prev   string
		win    window
		mark   *marker
	)
	switch {
	case cur.After != "":
		mark = newMarker(cur.After)
	case cur.Before != "":
		mark = newMarker(cur.Before)
	}
	err = h.browse(ctx, i, func(rec *dlq.Record) {
		// A row shows no payload: the page keeps the record without it.
		rec = rec.Summary()
		kinds.add(rec.Kind())
		at := 1 // the record's place against the cursor's
		if mark != nil {
			at = mark.place(rec)
		}
		if !match(rec) {
			return
		}
		d.Total++
		switch {
		case cur.Last || cur.Before != "" && at < 0:
			win.add(rec, size)
		case cur.Before != "":
			// Fewer records than a page before the cursor: the
			// page is the first one.
			if len(win.recs) < size {
				win.add(rec, size)
			}
		case cur.After != "" && at <= 0:
			before++
			prev = rec.Ref
		case len(page) < size:
			page = append(page, rec)
		}
	})
	if err != nil {
		h.fail(w, brokerStatus(err), err)
		return
	}
	d.Kinds = kinds.list
	if cur.Last || cur.Before != "" {
		page, before, prev = win.records(), win.dropped, win.lastDropped
	}
	if mark != nil && !mark.seen {
		// The record the link was made from is gone: where the page
		// was is not known.
		d.Gone, page, before, prev = mark.ref, nil, 0, ""
	}
	for _, rec := range page {
		d.Records = append(d.Records, toRow(rec))
	}
	d.From, d.To = before+1, before+len(page)
	d.PastEnd = d.Gone == "" && len(page) == 0 && d.Total > 0
	// Self shows this page again, from the record before it: replaying
	// the page's records leaves the link to the records that follow.
	switch {
	case d.Gone != "":
		d.Self = d.link(cur)
	case prev != "":
		d.Self = d.link(cursor{After: prev})
	default:
		d.Self = d.link(cursor{})
	}
	if before > 0 || d.Gone != "" || d.PastEnd {
		d.First = d.link(cursor{})
	}
	if before > 0 && len(page) > 0 {
		d.Prev = d.link(cursor{Before: page[0].Ref})
	}
	if d.To < d.Total && len(page) > 0 {
		d.Next = d.link(cursor{After: page[len(page)-1].Ref})
	}
	if d.To < d.Total || d.Gone != "" || d.PastEnd {
		d.Last = d.link(cursor{Last: true})
	}
	h.render(w, http.StatusOK, "list.html", h.page("Dead letters", d))
}

type recordData struct {
	Queue queueRef
	Row   row
	// Text or Hex shows the payload's first Shown bytes; Cut is set when
	// that is not all of them. Download links to every byte.
	Text, Hex string
	Shown     int
	Cut       bool
	Download  string
	// Key is the Kafka key, nil when the record has none; Headers are
	// the record's headers. Each is cut to field.Shown bytes (4 KiB): a
	// producer's may be as large as the record. The payload's download
	// has every byte of the payload only.
	Key     *clipped
	Headers []clippedHeader
	// Back is the listing the record was opened from, its filter and
	// page, passed on to a replay for the links back to it.
	Back string
}

func (h *Handler) record(w http.ResponseWriter, r *http.Request) {
	i, q, err := h.queueAt(r)
	if err != nil {
		h.fail(w, http.StatusNotFound, err)
		return
	}
	ref := r.FormValue("ref")
	back := backTo(r.FormValue("back"), i)
	ctx, cancel := h.ctx(r)
	defer cancel()
	recs, err := h.collect(ctx, i, dlq.Filter{Refs: []string{ref}})
	if err != nil {
		h.failBack(w, brokerStatus(err), err, back)
		return
	}
	if len(recs) == 0 {
		h.failBack(w, http.StatusNotFound, fmt.Errorf("no record %q in %s (replayed and removed, or never there)", ref, q.Name()), back)
		return
	}
	rec := recs[0]
	d := recordData{Queue: queueRef{i, q.Name()}, Row: toRow(rec), Back: back,
		Download: "payload?q=" + strconv.Itoa(i) + "&ref=" + url.QueryEscape(ref)}
	shown := rec.Value
	if len(shown) > payloadShown {
		shown, d.Cut = shown[:payloadShown], true
	}
	if dlq.Printable(rec.Value) {
		// Printable text is UTF-8: cut at the start of a character.
		for len(shown) > 0 && len(shown) < len(rec.Value) && !utf8.RuneStart(rec.Value[len(shown)]) {
			shown = shown[:len(shown)-1]
		}
		d.Text = string(shown)
	} else {
		d.Hex = hex.Dump(shown)
	}
	d.Shown = len(shown)
	if rec.Key != nil {
		k := clip(rec.Key, true)
		d.Key = &k
	}
	for _, hd := range rec.Headers {
		d.Headers = append(d.Headers, clippedHeader{Key: clip([]byte(hd.Key), false), Value: clip([]byte(hd.Value), false)})
	}
	h.render(w, http.StatusOK, "record.html", h.page("Dead letter "+ref, d))
}

// payloadShown is how many bytes of a payload a record's page shows: a
// payload of megabytes, a hex dump four times as long, would make a page
// the browser can hardly render. The page links to the whole payload.
const payloadShown = 32 << 10

// clipped is a field of a record as its page shows it: the first Shown of
// its Len bytes, Cut when that is not all of them.
type clipped struct {
	Text       string
	Shown, Len int
	Cut        bool
}

// clippedHeader is a header as a record's page shows it.
type clippedHeader struct {
	Key, Value clipped
}

// clip returns the first field.Shown bytes of b (field.Cut): as text when
// b is printable, else (with hexKey, a key) in hex with 0x before, or
// quoted with escapes.
func clip(b []byte, hexKey bool) clipped {
	c := clipped{Len: len(b)}
	shown, cut := field.Cut(b)
	c.Shown, c.Cut = len(shown), cut
	switch {
	case dlq.Printable(b):
		c.Text = string(shown)
	case hexKey:
		c.Text = "0x" + hex.EncodeToString(shown)
	default:
		c.Text = strconv.Quote(string(shown))
	}
	return c
}

// payload sends a record's payload, every byte, as a file to download.
func (h *Handler) payload(w http.ResponseWriter, r *http.Request) {
	i, q, err := h.queueAt(r)
	if err != nil {
		h.fail(w, http.StatusNotFound, err)
		return
	}
	ref := r.FormValue("ref")
	ctx, cancel := h.ctx(r)
	defer cancel()
	recs, err := h.collect(ctx, i, dlq.Filter{Refs: []string{ref}})
	if err != nil {
		h.fail(w, brokerStatus(err), err)
		return
	}
	if len(recs) == 0 {
		h.fail(w, http.StatusNotFound, fmt.Errorf("no record %q in %s (replayed and removed, or never there)", ref, q.Name()))
		return
	}
	name := strings.Map(func(c rune) rune {
		if c >= '0' && c <= '9' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' {
			return c
		}
		return '-'
	}, ref)
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Disposition", `attachment; filename="dead-letter-`+name+`.bin"`)
	w.Header().Set("Content-Length", strconv.Itoa(len(recs[0].Value)))
	_, _ = w.Write(recs[0].Value)
}

type replayData struct {
	Queue   queueRef
	Refs    []string
	Records []row
	Report  *dlq.Report
	// Missing counts the records posted that the read did not find
	// (replayed from another tab, or removed, since the page was made).
	Missing int
	// Back is the listing the replay was asked from, its filter and
	// page, for the links back to it.
	Back string
	// Token, on the confirmation, names the replay its form asks for.
	Token string
}

// backTo is the way back b to a listing of the queue at index i, as a
// form gave it: a link to this console's listing of that queue, else its
// unfiltered one.
func backTo(b string, i int) string {
	plain := "dlq?q=" + strconv.Itoa(i)
	if b == plain || strings.HasPrefix(b, plain+"&") {
		return b
	}
	return plain
}

// countRefs returns how many of refs (each once) the records of rep's
// outcomes have: two messages alike to the byte share a ref.
func countRefs(rep dlq.Report, refs []string) int {
	found := map[string]bool{}
	for _, o := range rep.Outcomes {
		if slices.Contains(refs, o.Record.Ref) {
			found[o.Record.Ref] = true
		}
	}
	return len(found)
}

// outcomes are recs as the outcomes of a report.
func outcomes(recs []*dlq.Record) []dlq.Outcome {
	out := make([]dlq.Outcome, len(recs))
	for i, r := range recs {
		out[i].Record = r
	}
	return out
}

// replay shows the confirmation page for the posted refs, or, with
// confirm=yes, replays them.
func (h *Handler) replay(w http.ResponseWriter, r *http.Request) {
	if !h.cfg.AllowReplay {
		h.fail(w, http.StatusForbidden, errors.New("the console is read-only: start it with replays allowed (once ui -allow-replay)"))
		return
	}
	if err := r.ParseForm(); err != nil {
		h.fail(w, http.StatusBadRequest, err)
		return
	}
	i, q, err := h.queueAt(r)
	if err != nil {
		h.fail(w, http.StatusNotFound, err)
		return
	}
	back := backTo(r.PostFormValue("back"), i)
	if tag := r.PostFormValue("queue"); tag != "" && tag != queueTag(q.Name()) {
		// The form was made by a console whose queue at this place was
		// another (started again with its destinations in another
		// order): a ref names a record of its own queue only, and a
		// Kafka ref ("0:0") is in every topic.
		h.failBack(w, http.StatusConflict, fmt.Errorf("the form was made for another dead-letter destination than %s, "+
			"now at its place (the console was started again with its destinations in another order): "+
			"nothing was replayed; open the dead letters again", q.Name()), back)
		return
	}
	refs := slices.Compact(slices.Sorted(slices.Values(r.PostForm["ref"])))
	if len(refs) == 0 {
		h.failBack(w, http.StatusBadRequest, errors.New("no record selected"), back)
		return
	}
	ctx, cancel := h.ctx(r)
	defer cancel()
	d := replayData{Queue: queueRef{i, q.Name()}, Refs: refs, Back: back}
	if r.PostFormValue("confirm") != "yes" {
		// The confirmation shows no payload: it keeps each record
		// without it (a selection of 500 dead letters of 1 MB would
		// hold half a gigabyte); the replay reads them anew.
		var recs []*dlq.Record
		f := dlq.Filter{Refs: refs}
		err := h.browse(ctx, i, func(rec *dlq.Record) {
			if f.Match(rec) {
				recs = append(recs, rec.Summary())
			}
		})
		if err != nil {
			h.failBack(w, brokerStatus(err), err, back)
			return
		}
		for _, rec := range recs {
			d.Records = append(d.Records, toRow(rec))
		}
		d.Missing = len(refs) - countRefs(dlq.Report{Outcomes: outcomes(recs)}, refs)
		d.Token = newToken()
		h.render(w, http.StatusOK, "confirm.html", h.page("Confirm replay", d))
		return
	}
	// A form's token names its replay: the same form posted again (a
	// reload of the page that answered it, a second click on its button
	// while the first was running) shows that replay's outcome and
	// replays nothing; each post would redrive the records again.
	res, first := h.results.start(r.PostFormValue("token"))
	if first {
		h.replayNow(ctx, res, i, refs, d)
	} else if err := waitFor(ctx, res); err != nil {
		h.failBack(w, http.StatusGatewayTimeout, fmt.Errorf("this form's replay, asked for before, is still running: "+
			"nothing was replayed again; the log says what it replays (%w)", err), back)
		return
	}
	if res.err != nil {
		h.failBack(w, res.status, res.err, res.data.Back)
		return
	}
	// The result page is a page of its own, which the browser is sent
	// to (POST, redirect, GET): a reload of it shows it again.
	w.Header().Set("Location", "replayed?id="+res.id)
	w.WriteHeader(http.StatusSeeOther)
}

// replayNow replays the records of refs in the queue at index i and keeps
// the outcome in res, whose page d is.
func (h *Handler) replayNow(ctx context.Context, res *result, i int, refs []string, d replayData) {
	defer close(res.done)
	res.data = d
	q := h.cfg.Queues[i]
	var rep dlq.Report
	var rerr error
	if err := h.use(ctx, i, func() {
		rep, rerr = q.Replay(ctx, dlq.Filter{Refs: refs}, dlq.ReplayOptions{By: h.cfg.By})
		h.cfg.Logger.Info("once console: replay", "queue", q.Name(), "selected", rep.Selected, "replayed", rep.Replayed,
			"skipped", rep.Skipped, "error", rerr)
	}); err != nil {
		if ctx.Err() != nil {
			// The replay had not returned when ctx ended: it stops
			// at once (the queues of package dlq) or at its next
			// record, and its report goes to the log.
			err = fmt.Errorf("the replay did not finish: %w; it stops, "+
				"and the log says what it replayed (replayed again, a record is deduplicated)", err)
		}
		res.status, res.err = brokerStatus(err), err
		return
	}
	if rerr != nil {
		if ctx.Err() != nil {
			rerr = h.stopped(ctx, q)
		}
		res.status, res.err = brokerStatus(rerr), fmt.Errorf("replay stopped after %d records: %w", rep.Replayed, rerr)
		return
	}
	res.data.Missing = len(refs) - countRefs(rep, refs)
	for i, o := range rep.Outcomes {
		if o.Record != nil {
			rep.Outcomes[i].Record = shownOutcome(o.Record)
		}
	}
	res.data.Report = &rep
}

// shownOutcome is what a result page shows of a replayed record, its ref
// and event id: the console keeps maxResults results of up to MaxRows
// records each.
func shownOutcome(r *dlq.Record) *dlq.Record {
	return &dlq.Record{Ref: r.Ref, Headers: []dlq.Header{{Key: consumer.HeaderEventID, Value: r.EventID()}}}
}

// waitFor waits until res's replay has ended, or ctx.
func waitFor(ctx context.Context, res *result) error {
	select {
	case <-res.done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// replayed shows the result of a replay that replay kept.
func (h *Handler) replayed(w http.ResponseWriter, r *http.Request) {
	res, ok := h.results.get(r.FormValue("id"))
	if !ok {
		h.fail(w, http.StatusNotFound, fmt.Errorf("the result of replay %q is no longer kept "+
			"(the console keeps the last %d, until it is started again): the dead letters say what is left", r.FormValue("id"), maxResults))
		return
	}
	ctx, cancel := h.ctx(r)
	defer cancel()
	if err := waitFor(ctx, res); err != nil {
		h.fail(w, http.StatusGatewayTimeout, fmt.Errorf("the replay is still running (%w)", err))
		return
	}
	if res.err != nil {
		h.failBack(w, res.status, res.err, res.data.Back)
		return
	}
	h.render(w, http.StatusOK, "result.html", h.page("Replayed", res.data))
}

// maxResults is how many replays' outcomes the console keeps.
const maxResults = 32

// result is the outcome of one replay: its page, or the error it failed
// with. done is closed once it is set.
type result struct {
	id     string
	done   chan struct{}
	data   replayData
	status int
	err    error
}

// results keeps the outcomes of the last maxResults replays, each under
// the token of the form that asked for it, or an id of its own.
type results struct {
	mu    sync.Mutex
	byID  map[string]*result
	order []string
}

// tokenBytes is the size of a token, before it is written in hex.
const tokenBytes = 16

// newToken returns an id that cannot be guessed.
func newToken() string {
	var b [tokenBytes]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read does not fail
	return hex.EncodeToString(b[:])
}

// start returns the replay of token and whether it is new, to be run by
// the caller. A token that newToken did not make (none, from a client
// that posts its own form) is replaced by an id of its own: the replay is
// new. The oldest replay past maxResults is let go.
func (rs *results) start(token string) (*result, bool) {
	if b, err := hex.DecodeString(token); err != nil || len(b) != tokenBytes {
		token = newToken()
	}
	rs.mu.Lock()
	defer rs.mu.Unlock()
	if res, ok := rs.byID[token]; ok {
		return res, false
	}
	if rs.byID == nil {
		rs.byID = map[string]*result{}
	}
	res := &result{id: token, done: make(chan struct{})}
	rs.byID[token] = res
	rs.order = append(rs.order, token)
	if len(rs.order) > maxResults {
		delete(rs.byID, rs.order[0])
		rs.order = rs.order[1:]
	}
	return res, true
}

func (rs *results) get(id string) (*result, bool) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	res, ok := rs.byID[id]
	return res, ok
}
