package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/onceco/once/cmd/once/console"
	"github.com/onceco/once/cmd/once/dlq"
)

const uiUsage = `Usage: once ui [-addr 127.0.0.1:8080] [-allow-replay] [-database-url URL] [-kafka BROKERS|-amqp URL -dlq NAMES]

Serves the web console: consumers and their status, dead letters by consumer
and kind with search, one record's headers and payload, and, with
-allow-replay, replays of one record or a selection after a confirmation
page. Read-only without -allow-replay. It binds to 127.0.0.1 by default and
has no login: put it behind your own access control before binding it
elsewhere. On a loopback address it answers only to requests addressed to
localhost or a loopback IP, so that another site cannot reach it through a
name it re-points at 127.0.0.1 (DNS rebinding). With -dlq it starts while the
database is down, and shows the consumers once it answers. A Kafka cluster
that asks for TLS or SASL takes the -kafka-tls, -kafka-ca, -kafka-cert,
-kafka-key, -kafka-sasl, -kafka-user and -kafka-password-file flags (or
env ONCE_KAFKA_SASL_PASSWORD), as once dlq does.`

func (a *app) ui(ctx context.Context, args []string) error {
	fs, helpOnly := a.flags(ctx, "ui")
	db := a.dbFlagsOn(fs)
	addr := fs.String("addr", "127.0.0.1:8080", "`address` to listen on")
	allow := fs.Bool("allow-replay", false, "allow replays (default: read-only)")
	by := fs.String("by", "once console", "written in once-redriven-by on replays")
	kafka := a.kafkaFlagsOn(fs)
	amqpURL := fs.String("amqp", a.getenv("ONCE_AMQP_URL"), "RabbitMQ `URL` (env ONCE_AMQP_URL)")
	names := fs.String("dlq", "", "dead-letter topics or queues, comma-separated")
	if helpOnly {
		return nil
	}
	if err := parse(fs, args); err != nil {
		return err
	}
	if _, port, err := net.SplitHostPort(*addr); err != nil {
		return usagef("-addr %q: want host:port, such as 127.0.0.1:8080", *addr)
	} else if _, err := net.LookupPort("tcp", port); err != nil {
		return usagef("-addr %q: %v", *addr, err)
	}
	cfg := console.Config{Tables: db.tables(), AllowReplay: *allow, By: *by,
		Logger: slog.New(slog.NewTextHandler(a.stderr, nil))}
	kb, au := chosen(fs, *kafka.brokers, *amqpURL)
	if names := splitList(*names); len(names) > 0 {
		qs, err := kafka.open(a.stderr, kb, au, names, dlq.AMQPConfig{})
		if err != nil {
			return err
		}
		cfg.Queues = qs
	}
	if *db.url != "" {
		pool, err := db.open(ctx)
		if err != nil {
			return err
		}
		defer pool.Close()
		if err := pool.Ping(ctx); err != nil {
			err = db.connectError(ctx, err)
			if len(cfg.Queues) == 0 {
				return err
			}
			// The dead letters are worth serving meanwhile (an
			// incident is when the console is needed); the consumers
			// page says the database's error until it answers.
			fmt.Fprintf(a.stderr, "once ui: %s; serving the dead letters, and the consumers once it answers\n",
				safe(err.Error()))
		}
		cfg.DB = pool
	}
	h, err := console.New(cfg)
	if err != nil {
		return &usageError{err.Error() + " (give -database-url, -dlq, or both)"}
	}
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		return err
	}
	mode := "read-only"
	if *allow {
		mode = "replays allowed"
	}
	fmt.Fprintf(a.stdout, "once console on http://%s/ (%s)\n", ln.Addr(), mode)
	var handler http.Handler = h
	if isLoopback(ln.Addr()) {
		handler = loopbackHostsOnly(h)
	}
	// The requests' contexts end with ctx: at an interrupt a page that
	// waits on a broker stops, and so does a replay, as once dlq replay
	// does; the shutdown then has nothing to wait for.
	// No client holds a connection for ever: not by sending its header
	// or body slowly (slow loris), not by leaving it idle between
	// requests, not by leaving a response unread.
	srv := &http.Server{Handler: handler, ReadHeaderTimeout: uiTimeouts.ReadHeader, ReadTimeout: uiTimeouts.Read,
		WriteTimeout: uiTimeouts.Write, IdleTimeout: uiTimeouts.Idle,
		BaseContext: func(net.Listener) context.Context { return ctx }}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		sctx, cancel := context.WithTimeout(context.Background(), uiShutdownGrace)
		defer cancel()
		if err := srv.Shutdown(sctx); err != nil {
			if !errors.Is(err, context.DeadlineExceeded) {
				return err
			}
			// A client holds its request unfinished (a body it does not
			// send, a response it does not read), which no context
			// ends: past the grace its connection is cut. The stop is
			// the user's, not a failure.
			fmt.Fprintf(a.stderr, "once ui: closing the connections of clients that did not finish their requests within %v\n", uiShutdownGrace)
			_ = srv.Close()
		}
		if err := <-done; !errors.Is(err, http.ErrServerClosed) {
			return err
		}
		return nil
	}
}

// uiShutdownGrace is how long once ui, stopping, waits for clients to
// finish the requests in flight (a download of a payload) before it closes
// their connections.
const uiShutdownGrace = 10 * time.Second

// serverTimeouts are the bounds of the console's server on a connection:
// ReadHeader on a request's header, Read on its header and body, Write
// from the end of its header to the end of its response, Idle on a
// keep-alive connection between requests.
type serverTimeouts struct {
	ReadHeader, Read, Write, Idle time.Duration
}

// uiTimeouts are once ui's. Write leaves room for a page's broker and
// database work, which console.Config.Timeout bounds (30 s), and for a
// payload's download.
var uiTimeouts = serverTimeouts{ReadHeader: 10 * time.Second, Read: 30 * time.Second,
	Write: 2 * time.Minute, Idle: 2 * time.Minute}

// isLoopback reports whether addr is a loopback TCP address.
func isLoopback(addr net.Addr) bool {
	ta, ok := addr.(*net.TCPAddr)
	return ok && ta.IP.IsLoopback()
}

// loopbackHostsOnly refuses requests addressed to any host name but a
// loopback one. A console on a loopback address has no login: a page of
// another site whose name is re-pointed at 127.0.0.1 (DNS rebinding) is
// same-origin for the browser, so the cross-origin check lets its replays
// through, and it can read every page. Its requests carry its own name.
func loopbackHostsOnly(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host := r.Host
		if h, _, err := net.SplitHostPort(host); err == nil {
			host = h
		}
		host = strings.TrimSuffix(strings.ToLower(host), ".")
		ip := net.ParseIP(strings.Trim(host, "[]"))
		if host != "localhost" && !strings.HasSuffix(host, ".localhost") && (ip == nil || !ip.IsLoopback()) {
			http.Error(w, "once console: this console answers only to a loopback address (localhost, 127.0.0.1, [::1]); "+
				"bind it elsewhere with -addr, behind your own access control, to reach it by another name", http.StatusForbidden)
			return
		}
		next.ServeHTTP(w, r)
	})
}
