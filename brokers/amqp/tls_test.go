package amqp_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"net"
	"net/url"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/brokers/amqp"
	"github.com/onceco/once/internal/testcert"
)

// TestTLSConfigIsUsed dials an amqps URL whose server is a TLS listener of
// the test that requires a client certificate: with Config.TLSConfig
// trusting the server and presenting a client certificate, the TLS
// handshake succeeds (the AMQP handshake then fails, as the server speaks
// no AMQP); without it, the server's certificate is rejected.
func TestTLSConfigIsUsed(t *testing.T) {
	t.Parallel()
	server, client := testcert.SelfSigned(t, "test-server"), testcert.SelfSigned(t, "test-client")
	roots := x509.NewCertPool()
	roots.AddCert(server.Leaf)
	clientCAs := x509.NewCertPool()
	clientCAs.AddCert(client.Leaf)
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{
		Certificates: []tls.Certificate{server},
		ClientAuth:   tls.RequireAndVerifyClientCert,
		ClientCAs:    clientCAs,
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = ln.Close() })
	peers := make(chan string, 16)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			tc := c.(*tls.Conn)
			if tc.Handshake() == nil {
				select {
				case peers <- tc.ConnectionState().PeerCertificates[0].Subject.CommonName:
				default:
				}
			}
			_ = c.Close()
		}
	}()
	url := "amqps://guest:guest@" + ln.Addr().String() + "/"
	// A server that speaks no AMQP is retried until ctx ends; a rejected
	// certificate is returned at once, so its bound only needs to outlast
	// a slow handshake on a busy machine (300 ms did not, in CI).
	open := func(cfg *tls.Config, bound time.Duration) error {
		ctx, cancel := context.WithTimeout(context.Background(), bound)
		defer cancel()
		_, err := amqp.Open(ctx, amqp.Config{URL: url, Queue: "q", TLSConfig: cfg, Logger: testLogger(t),
			ReconnectMinBackoff: 50 * time.Millisecond, ReconnectMaxBackoff: 50 * time.Millisecond})
		return err
	}

	err = open(&tls.Config{RootCAs: roots, Certificates: []tls.Certificate{client}}, 2*time.Second)
	require.Error(t, err, "the server speaks no AMQP")
	assert.NotContains(t, err.Error(), "certificate")
	select {
	case cn := <-peers:
		assert.Equal(t, "test-client", cn, "the client certificate of Config.TLSConfig was presented")
	case <-time.After(5 * time.Second):
		t.Fatal("no TLS handshake completed")
	}

	err = open(nil, 30*time.Second)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "certificate", "without Config.TLSConfig the system roots reject the server")
}

// TestTLSConfigIsNotModified: one tls.Config given to sources of two
// brokers (a cluster's nodes, each with a certificate of its own name).
// The source dials with a copy: amqp091 writes the URL's host into an
// empty ServerName of the config it is given, and the second broker's
// certificate was then checked against the first broker's name, and
// refused.
func TestTLSConfigIsNotModified(t *testing.T) {
	t.Parallel()
	listen := func(cert tls.Certificate) string {
		ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{Certificates: []tls.Certificate{cert}})
		require.NoError(t, err)
		t.Cleanup(func() { _ = ln.Close() })
		go func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				_ = c.(*tls.Conn).Handshake()
				_ = c.Close()
			}
		}()
		return ln.Addr().(*net.TCPAddr).String()
	}
	byIP := testcert.SelfSigned(t, "by-ip") // for 127.0.0.1
	byName := testcert.ForName(t, "by-name", "localhost")
	roots := x509.NewCertPool()
	roots.AddCert(byIP.Leaf)
	roots.AddCert(byName.Leaf)
	shared := &tls.Config{RootCAs: roots}
	_, portByName, err := net.SplitHostPort(listen(byName))
	require.NoError(t, err)

	open := func(url string) error {
		// Long enough for the handshake on a busy machine: a first
		// attempt cut before it would pass without checking the name.
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_, err := amqp.Open(ctx, amqp.Config{URL: url, Queue: "q", TLSConfig: shared, Logger: testLogger(t),
			ReconnectMinBackoff: 50 * time.Millisecond, ReconnectMaxBackoff: 50 * time.Millisecond})
		return err
	}
	err = open("amqps://guest:guest@" + listen(byIP) + "/")
	require.Error(t, err, "the server speaks no AMQP")
	assert.NotContains(t, err.Error(), "certificate")
	assert.Empty(t, shared.ServerName, "Open wrote into the caller's tls.Config")

	err = open("amqps://guest:guest@localhost:" + portByName + "/")
	require.Error(t, err, "the server speaks no AMQP")
	assert.NotContains(t, err.Error(), "certificate", "the second broker's certificate was checked against the first one's name")
}

// tlsListener serves TLS with cfg and closes every connection after the
// handshake: its address, and whether the handshake was reached.
func tlsListener(t *testing.T, cfg *tls.Config) string {
	t.Helper()
	ln, err := tls.Listen("tcp", "127.0.0.1:0", cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				_ = c.(*tls.Conn).Handshake()
				buf := make([]byte, 64)
				_, _ = c.Read(buf) // TLS 1.3 sends its verdict on the client certificate after the handshake
				_ = c.Close()
			}()
		}
	}()
	return ln.Addr().String()
}

// A TLS handshake that fails for what the two sides are configured with
// (a certificate not trusted, a client certificate missing, amqps to a
// port that speaks plain AMQP) fails on every attempt: Open returns it at
// once, saying it is TLS, instead of retrying it as a broker that cannot
// be reached until ctx ends.
func TestOpenReturnsATLSRefusalAtOnce(t *testing.T) {
	t.Parallel()
	server, client := testcert.SelfSigned(t, "test-server"), testcert.SelfSigned(t, "test-client")
	roots := x509.NewCertPool()
	roots.AddCert(server.Leaf)
	clientCAs := x509.NewCertPool()
	clientCAs.AddCert(client.Leaf)
	plain, err := url.Parse(brokerURL(t))
	require.NoError(t, err)
	plain.Scheme = "amqps"

	for _, tc := range []struct {
		name string
		url  string
		tls  *tls.Config
		want string
	}{{
		name: "untrusted certificate",
		url:  "amqps://guest:s3cret@" + tlsListener(t, &tls.Config{Certificates: []tls.Certificate{server}}) + "/",
		want: "certificate",
	}, {
		name: "client certificate missing",
		url: "amqps://guest:s3cret@" + tlsListener(t, &tls.Config{Certificates: []tls.Certificate{server},
			ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: clientCAs}) + "/",
		tls:  &tls.Config{RootCAs: roots},
		want: "certificate required",
	}, {
		name: "amqps to a plain AMQP port",
		url:  plain.String(),
		want: "does not look like a TLS handshake",
	}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			src, err := amqp.Open(ctx, amqp.Config{URL: tc.url, Queue: "q", TLSConfig: tc.tls, Logger: testLogger(t),
				ReconnectMinBackoff: 10 * time.Millisecond, ReconnectMaxBackoff: 50 * time.Millisecond})
			if src != nil {
				_ = src.Close()
			}
			require.Error(t, err)
			t.Log(err)
			assert.NoError(t, ctx.Err(), "the refusal was retried until the context ended: %v", err)
			assert.Contains(t, err.Error(), tc.want)
			assert.Contains(t, err.Error(), "TLS handshake")
			assert.NotContains(t, err.Error(), "s3cret")
		})
	}
}
