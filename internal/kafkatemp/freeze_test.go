package kafkatemp

import (
	"os"
	"os/exec"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Freeze returns only once every thread of the process has stopped: a
// process of busy threads (more than this machine's cores, as a loaded
// JVM's are) has none running when stopAndWait returns, each time.
func TestStopAndWaitReturnsWhenEveryThreadStopped(t *testing.T) {
	if _, err := os.Stat("/proc/self/task"); err != nil {
		t.Skip("no /proc: thread states cannot be read here")
	}
	child := exec.Command(os.Args[0], "-test.run=^TestHelperBusyThreads$")
	child.Env = append(os.Environ(), "ONCE_BUSY_THREADS=1")
	require.NoError(t, child.Start())
	t.Cleanup(func() {
		_ = child.Process.Kill()
		_ = child.Wait()
	})
	require.Eventually(t, func() bool {
		running, err := runningThreads(child.Process.Pid)
		return err == nil && len(running) >= 2*runtime.NumCPU()
	}, 10*time.Second, 5*time.Millisecond, "the child's busy threads run")

	for range 20 {
		require.NoError(t, stopAndWait(child.Process, 10*time.Second))
		running, err := runningThreads(child.Process.Pid)
		require.NoError(t, err)
		assert.Empty(t, running, "threads still running after stopAndWait returned")
		require.NoError(t, child.Process.Signal(syscall.SIGCONT))
		require.Eventually(t, func() bool {
			running, err := runningThreads(child.Process.Pid)
			return err == nil && len(running) > 0
		}, 10*time.Second, time.Millisecond, "the child runs again after SIGCONT")
	}
}

// TestHelperBusyThreads is the child of
// TestStopAndWaitReturnsWhenEveryThreadStopped: twice as many threads as
// cores, each spinning, until it is killed.
func TestHelperBusyThreads(t *testing.T) {
	if os.Getenv("ONCE_BUSY_THREADS") != "1" {
		t.Skip("run as a child process only")
	}
	for range 2*runtime.NumCPU() + 1 {
		go func() {
			runtime.LockOSThread()
			spins := 0
			for {
				spins++
			}
		}()
	}
	select {}
}
