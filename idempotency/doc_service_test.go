package idempotency_test

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/idempotency"
	"github.com/onceco/once/internal/pgtest"
)

// docService is the complete service docs/http.md shows: the first Go
// block of the page, which must be testdata/service/main.go to the byte.
func docService(t *testing.T) string {
	t.Helper()
	doc, err := os.ReadFile("../docs/http.md")
	require.NoError(t, err)
	m := regexp.MustCompile("(?s)```go\n(.*?)```").FindSubmatch(doc)
	require.NotNil(t, m, "docs/http.md has no Go block")
	return string(m[1])
}

// The service in docs/http.md is under 40 lines, is the file this test
// builds, and does what the page says: a retried payment is paid once, and
// the same key from another client is another payment.
func TestDocumentedServiceRuns(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs a program")
	}
	file, err := os.ReadFile("testdata/service/main.go")
	require.NoError(t, err)
	require.Equal(t, string(file), docService(t), "docs/http.md shows testdata/service/main.go")
	require.Less(t, strings.Count(string(file), "\n"), 40, "under 40 lines")

	bin := filepath.Join(t.TempDir(), "service")
	build := exec.Command("go", "build", "-o", bin, "./testdata/service")
	out, err := build.CombinedOutput()
	require.NoError(t, err, "%s", out)

	pool, schema := pgtest.Schema(t)
	ctx := context.Background()
	_, err = pool.Exec(ctx, `CREATE TABLE payments (id bigserial PRIMARY KEY, amount int NOT NULL)`)
	require.NoError(t, err)
	dbURL, err := url.Parse(pgtest.URL())
	require.NoError(t, err)
	q := dbURL.Query()
	q.Set("search_path", schema)
	dbURL.RawQuery = q.Encode()
	addr := freeAddr(t)
	cmd := exec.Command(bin)
	cmd.Env = append(os.Environ(), "DATABASE_URL="+dbURL.String(), "ADDR="+addr)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	require.Eventually(t, func() bool {
		c, err := net.Dial("tcp", addr)
		if err == nil {
			_ = c.Close()
		}
		return err == nil
	}, 30*time.Second, 10*time.Millisecond, "the service listens")

	pay := func(user, key, amount string) reply {
		req, err := http.NewRequest(http.MethodPost, "http://"+addr+"/payments", strings.NewReader("amount="+amount))
		require.NoError(t, err)
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		req.Header.Set(idempotency.DefaultHeader, key)
		req.SetBasicAuth(user, "secret")
		resp, err := client.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return reply{status: resp.StatusCode, header: resp.Header, body: string(body)}
	}
	first := pay("alice", "pay-1", "42")
	require.Equal(t, http.StatusCreated, first.status, first.body)
	again := pay("alice", "pay-1", "42")
	assert.True(t, again.replayed())
	assert.Equal(t, first.body, again.body)
	assert.Equal(t, http.StatusUnprocessableEntity, pay("alice", "pay-1", "43").status)
	assert.Equal(t, http.StatusCreated, pay("bob", "pay-1", "42").status)
	assert.Equal(t, http.StatusBadRequest, pay("alice", "pay-2", "lots").status)
	assert.Equal(t, 2, count(t, pool, `SELECT count(*) FROM payments`))
}

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	return ln.Addr().String()
}
