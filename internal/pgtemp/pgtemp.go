// Package pgtemp starts a throwaway PostgreSQL server from the machine's
// PostgreSQL binaries: a fresh cluster in a temporary directory, listening on
// a free loopback port, removed by Close. Tests and the example use it when
// no DATABASE_URL is given.
//
// initdb and postgres refuse to run as root, so when the process is root the
// server runs as the "postgres" user if it exists, else as "nobody".
//
// pg_ctl detaches the server from the process that starts it, so a process
// killed before Close (a test binary past its timeout) would leave the
// server running. A watchdog started with the server stops it and removes
// its directory within about a second of the starting process's death.
package pgtemp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/onceco/once/internal/freeport"
)

// Options tune the throwaway server. The zero value is a server with fsync
// off (fast, fine for tests) on a free port.
type Options struct {
	// Durable keeps fsync and synchronous_commit on, as in production; use
	// it for benchmarks. Defaults to false.
	Durable bool
	// Port to listen on; 0 picks a free loopback port.
	Port int
}

// Server is a running throwaway PostgreSQL server.
type Server struct {
	dir     string
	bindir  string
	port    int
	durable bool
	cred    *syscall.Credential
	// watchdog stops the server if this process dies before Close.
	watchdog *exec.Cmd
}

// Start creates and starts a new cluster. It fails with a message that says
// how to install PostgreSQL when no binaries are found.
func Start(ctx context.Context, opts Options) (*Server, error) {
	bindir, err := findBinDir()
	if err != nil {
		return nil, err
	}
	s := &Server{bindir: bindir, port: opts.Port, durable: opts.Durable}
	if s.port == 0 {
		if s.port, err = freePort(); err != nil {
			return nil, err
		}
	}
	if s.dir, err = os.MkdirTemp("", "once-pg-"); err != nil {
		return nil, err
	}
	if err := s.prepareOwner(); err != nil {
		s.Close()
		return nil, err
	}
	if err := s.run(ctx, "initdb", "-D", s.dataDir(), "-U", "postgres", "-A", "trust",
		"-E", "UTF8", "--no-sync", "--no-instructions"); err != nil {
		s.Close()
		return nil, err
	}
	if err := s.Restart(ctx); err != nil {
		s.Close()
		return nil, err
	}
	if err := s.startWatchdog(); err != nil {
		s.Close()
		return nil, err
	}
	return s, nil
}

// watchdogScript waits for process $1 to end, then stops the server of
// data directory $3 with pg_ctl ($2) and removes $4. It tests /proc rather
// than kill -0, which fails for another user's live process.
const watchdogScript = `while [ -d "/proc/$1" ]; do sleep 1; done
"$2" -D "$3" -m immediate -w -t 60 stop >/dev/null 2>&1
rm -rf "$4"`

// startWatchdog starts the watchdog: a shell in a process group of its
// own (a test's interrupt does not reach it) and as the server's user.
func (s *Server) startWatchdog() error {
	cmd := exec.Command("/bin/sh", "-c", watchdogScript, "pgtemp-watchdog",
		strconv.Itoa(os.Getpid()), filepath.Join(s.bindir, "pg_ctl"), s.dataDir(), s.dir)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: s.cred}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("pgtemp: watchdog: %w", err)
	}
	s.watchdog = cmd
	return nil
}

// URL is the connection string of the server's "postgres" database.
func (s *Server) URL() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", s.port)
}

// Port is the loopback port the server listens on.
func (s *Server) Port() int { return s.port }

// Restart starts the server again after Stop, on the same port and data.
// Calling it on a running server is an error from pg_ctl.
func (s *Server) Restart(ctx context.Context) error {
	opts := fmt.Sprintf("-c listen_addresses=127.0.0.1 -p %d -k %s -c max_connections=300", s.port, s.dir)
	if !s.durable {
		opts += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
	}
	return s.run(ctx, "pg_ctl", "-D", s.dataDir(), "-l", filepath.Join(s.dir, "server.log"),
		"-o", opts, "-w", "-t", "60", "start")
}

// Stop stops the server, disconnecting every client at once (fast mode).
// Restart brings it back.
func (s *Server) Stop(ctx context.Context) error {
	return s.run(ctx, "pg_ctl", "-D", s.dataDir(), "-m", "fast", "-w", "-t", "60", "stop")
}

// Crash stops the server as a crash would (immediate mode: no checkpoint,
// and recovery from the WAL at the next start, which empties unlogged
// tables). Restart brings it back.
func (s *Server) Crash(ctx context.Context) error {
	return s.run(ctx, "pg_ctl", "-D", s.dataDir(), "-m", "immediate", "-w", "-t", "60", "stop")
}

// Close stops the server if it runs and removes its directory.
func (s *Server) Close() error {
	if s.watchdog != nil {
		_ = s.watchdog.Process.Kill()
		_ = s.watchdog.Wait()
		s.watchdog = nil
	}
	if s.dir == "" {
		return nil
	}
	if _, err := os.Stat(filepath.Join(s.dataDir(), "postmaster.pid")); err == nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		_ = s.run(ctx, "pg_ctl", "-D", s.dataDir(), "-m", "immediate", "-w", "stop")
		cancel()
	}
	err := os.RemoveAll(s.dir)
	s.dir = ""
	return err
}

// Dir is the server's directory, its data directory inside it: a place on
// the disk the server writes its WAL to.
func (s *Server) Dir() string { return s.dir }

func (s *Server) dataDir() string { return filepath.Join(s.dir, "data") }

func (s *Server) run(ctx context.Context, name string, args ...string) error {
	cmd := exec.CommandContext(ctx, filepath.Join(s.bindir, name), args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	// pg_ctl start leaves the server running in its own process group, so
	// a test's interrupt does not take it down before Close runs.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: s.cred}
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("pgtemp: %s: %w: %s", name, err, strings.TrimSpace(out.String()))
	}
	return nil
}

// prepareOwner arranges for the server to run as an unprivileged user when
// this process is root.
func (s *Server) prepareOwner() error {
	if os.Geteuid() != 0 {
		return nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		if u, err = user.Lookup("nobody"); err != nil {
			return errors.New("pgtemp: running as root and neither a postgres nor a nobody user exists")
		}
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	s.cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
	return os.Chown(s.dir, uid, gid)
}

// findBinDir finds the directory holding initdb, pg_ctl and postgres:
// $PG_BINDIR, else the newest /usr/lib/postgresql/*/bin, else PATH.
func findBinDir() (string, error) {
	if d := os.Getenv("PG_BINDIR"); d != "" {
		return d, nil
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool { return versionOf(dirs[i]) > versionOf(dirs[j]) })
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "initdb")); err == nil {
			return d, nil
		}
	}
	if p, err := exec.LookPath("initdb"); err == nil {
		return filepath.Dir(p), nil
	}
	return "", errors.New("pgtemp: no PostgreSQL server binaries found (initdb); install them with `apt-get install postgresql` or set DATABASE_URL")
}

func versionOf(bindir string) int {
	v, _ := strconv.Atoi(filepath.Base(filepath.Dir(bindir)))
	return v
}

// freePort picks the server's port below the ephemeral range, so that a
// restart finds it free again (internal/freeport).
func freePort() (int, error) { return freeport.Pick() }
