package kafkatemp

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// freezeWait bounds Freeze's wait for the node's threads to stop.
const freezeWait = 10 * time.Second

// stopAndWait sends p SIGSTOP and returns once every thread of p is
// stopped, or an error after timeout. kill(2) only queues the signal: the
// stop of the whole thread group begins when one of its threads next runs
// and takes the signal, and on a loaded machine the JVM's other threads go
// on reading requests and answering them until then. A test that freezes
// a broker and then sends it a request must not find it answered. Where
// /proc cannot be read (not Linux), it returns after the signal.
func stopAndWait(p *os.Process, timeout time.Duration) error {
	if err := p.Signal(syscall.SIGSTOP); err != nil {
		return fmt.Errorf("kafkatemp: SIGSTOP to pid %d: %w", p.Pid, err)
	}
	deadline := time.Now().Add(timeout)
	for {
		running, err := runningThreads(p.Pid)
		if errors.Is(err, os.ErrNotExist) && running == nil {
			return nil
		}
		if err != nil {
			return err
		}
		if len(running) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("kafkatemp: pid %d: threads %v not stopped %v after SIGSTOP", p.Pid, running, timeout)
		}
		time.Sleep(time.Millisecond)
	}
}

// runningThreads returns the ids of p's threads that are not stopped
// (state T, or t under a tracer) and have not exited. It returns a nil
// slice and an error wrapping os.ErrNotExist when /proc has no tasks of
// pid (no /proc, or the process is gone).
func runningThreads(pid int) ([]string, error) {
	tasks, err := filepath.Glob(filepath.Join("/proc", fmt.Sprint(pid), "task", "*", "stat"))
	if err != nil {
		return nil, fmt.Errorf("kafkatemp: threads of pid %d: %w", pid, err)
	}
	if len(tasks) == 0 {
		return nil, fmt.Errorf("kafkatemp: threads of pid %d: %w", pid, os.ErrNotExist)
	}
	running := []string{}
	for _, f := range tasks {
		b, err := os.ReadFile(f)
		if err != nil {
			continue // the thread exited since the listing
		}
		if state := threadState(string(b)); !strings.ContainsRune("TtZX", state) {
			running = append(running, filepath.Base(filepath.Dir(f)))
		}
	}
	return running, nil
}

// threadState returns the state letter of a /proc/<pid>/task/<tid>/stat
// line: the field after the command name, which is in parentheses and may
// itself hold spaces and parentheses.
func threadState(stat string) rune {
	i := strings.LastIndexByte(stat, ')')
	if i < 0 || i+2 >= len(stat) {
		return '?'
	}
	return rune(stat[i+2])
}
