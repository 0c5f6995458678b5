package pgtemp

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const childEnv = "PGTEMP_TEST_CHILD"

// TestMain lets the test binary play the process that starts a server and
// dies without closing it.
func TestMain(m *testing.M) {
	if os.Getenv(childEnv) == "1" {
		startAndHang()
		return
	}
	os.Exit(m.Run())
}

func startAndHang() {
	srv, err := Start(context.Background(), Options{})
	if err != nil {
		fmt.Println("error", err)
		os.Exit(1)
	}
	fmt.Println(srv.Port(), srv.dir)
	select {} // until killed
}

func listening(port int) bool {
	c, err := net.DialTimeout("tcp", "127.0.0.1:"+strconv.Itoa(port), time.Second)
	if err != nil {
		return false
	}
	_ = c.Close()
	return true
}

// requireBinDir skips the test where PostgreSQL's server binaries are not
// installed, or fails it under ONCE_REQUIRE_SERVERS=1 (make test), where
// every other test binary needs them too.
func requireBinDir(t *testing.T) {
	t.Helper()
	if _, err := findBinDir(); err != nil {
		if os.Getenv("ONCE_REQUIRE_SERVERS") == "1" {
			t.Fatalf("%v (ONCE_REQUIRE_SERVERS=1)", err)
		}
		t.Skip(err)
	}
}

// TestServerDiesWithItsProcess: a process killed without Close leaves no
// server and no directory behind.
func TestServerDiesWithItsProcess(t *testing.T) {
	requireBinDir(t)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"=1")
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	line, err := bufio.NewReader(out).ReadString('\n')
	require.NoError(t, err)
	fields := strings.Fields(line)
	require.Len(t, fields, 2, line)
	port, err := strconv.Atoi(fields[0])
	require.NoError(t, err, line)
	dir := fields[1]
	require.True(t, listening(port), "the child's server runs")
	require.DirExists(t, dir)

	require.NoError(t, cmd.Process.Kill())
	_ = cmd.Wait()
	assert.Eventually(t, func() bool { return !listening(port) }, 30*time.Second, 50*time.Millisecond,
		"the server outlived the process that started it")
	assert.Eventually(t, func() bool { _, err := os.Stat(dir); return os.IsNotExist(err) }, 30*time.Second, 50*time.Millisecond,
		"the server's directory was left behind")
}

// TestCloseStopsTheWatchdog: Close stops the server and the watchdog, and a
// stopped and restarted server is still watched.
func TestCloseStopsTheWatchdog(t *testing.T) {
	requireBinDir(t)
	ctx := context.Background()
	srv, err := Start(ctx, Options{})
	require.NoError(t, err)
	require.NotNil(t, srv.watchdog)
	require.NoError(t, srv.Stop(ctx))
	require.NoError(t, srv.Restart(ctx))
	assert.Nil(t, srv.watchdog.ProcessState, "the watchdog outlives a restart")
	w, dir := srv.watchdog, srv.dir
	require.NoError(t, srv.Close())
	assert.NotNil(t, w.ProcessState, "Close waited for the watchdog")
	assert.NoDirExists(t, dir)
	assert.False(t, listening(srv.Port()))
}
