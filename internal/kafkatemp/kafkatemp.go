package kafkatemp

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/IBM/sarama"

	"github.com/onceco/once/internal/freeport"
)

// Options tune a throwaway cluster. The zero value is one node with a
// 256 MB heap, the test settings of the package doc and a client-side JIT
// tuned for start-up.
type Options struct {
	// Nodes is the number of nodes, each a combined KRaft controller and
	// broker. Default 1. With 3 nodes the internal topics and new topics get
	// replication factor 3.
	Nodes int
	// HeapMB is each node's maximum Java heap in MB. Default 256.
	HeapMB int
	// FullJIT keeps the JVM's optimising compiler (slower start, faster
	// steady state); use it for benchmarks. Default false: the client
	// compiler only, which starts about twice as fast on 2 cores.
	FullJIT bool
	// Properties are broker properties that override the defaults
	// (for example "message.max.bytes" or "min.insync.replicas").
	Properties map[string]string
	// StartTimeout bounds how long Start waits for the cluster to be ready.
	// Default 2 minutes.
	StartTimeout time.Duration
	// SASLUsers, when not empty, makes the client listener ask for SASL
	// PLAIN authentication (SASL_PLAINTEXT) and accept these users and
	// passwords, and AdminUser with the password AdminUser, which the
	// nodes use between themselves and Start uses to see them ready.
	SASLUsers map[string]string
	// Dir is the directory in which the cluster's own directory (its
	// logs, configuration and data) is made, and removed by Close.
	// Default the system's temporary directory (os.TempDir). A
	// memory-backed one (/dev/shm) keeps the broker's writes off a disk
	// that a database beside it syncs its WAL to.
	Dir string
}

// Cluster is a running throwaway Kafka cluster. Its methods are safe for
// concurrent use.
type Cluster struct {
	dir       string
	libs      string
	clusterID string
	opts      Options
	nodes     []*node
	watchdog  *exec.Cmd

	mu     sync.Mutex
	closed bool
}

// node is one KRaft node (controller and broker in one JVM).
type node struct {
	id             int
	port, ctrlPort int
	dir            string

	mu      sync.Mutex
	cmd     *exec.Cmd
	exited  chan struct{} // closed when cmd's process ended
	waitErr error         // cmd.Wait's result, set before exited is closed
	stopped bool          // set by stop: the node's end was asked for
}

func (n *node) exitErr() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.waitErr
}

func (n *node) wasStopped() bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.stopped
}

// Start fetches nothing: it starts a cluster from the jars found by Libs,
// formats each node's storage, starts the nodes and waits until every
// broker is registered and answers metadata requests. It returns an error
// that says how to fetch Kafka when the jars or Java are missing, and the
// tail of a node's log when a node dies during start-up.
func Start(ctx context.Context, opts Options) (*Cluster, error) {
	opts = opts.withDefaults()
	libs, err := Libs()
	if err != nil {
		return nil, err
	}
	if _, err := exec.LookPath("java"); err != nil {
		return nil, errors.New("kafkatemp: java is not installed: apt-get install openjdk-17-jre-headless (scripts/ensure-deps.sh kafka)")
	}
	dir, err := os.MkdirTemp(opts.Dir, "once-kafka-")
	if err != nil {
		return nil, err
	}
	c := &Cluster{dir: dir, libs: libs, clusterID: newClusterID(), opts: opts}
	if err := c.startWatchdog(); err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	if err := c.start(ctx); err != nil {
		_ = c.Close()
		return nil, err
	}
	return c, nil
}

func (o Options) withDefaults() Options {
	if o.Nodes <= 0 {
		o.Nodes = 1
	}
	if o.HeapMB <= 0 {
		o.HeapMB = 256
	}
	if o.StartTimeout <= 0 {
		o.StartTimeout = 2 * time.Minute
	}
	return o
}

func (c *Cluster) start(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, c.opts.StartTimeout)
	defer cancel()
	for i := range c.opts.Nodes {
		n := &node{id: i + 1, dir: filepath.Join(c.dir, "node-"+strconv.Itoa(i+1))}
		var err error
		if n.port, err = freePort(); err != nil {
			return err
		}
		if n.ctrlPort, err = freePort(); err != nil {
			return err
		}
		c.nodes = append(c.nodes, n)
	}
	for _, n := range c.nodes {
		if err := c.writeConfig(n); err != nil {
			return err
		}
		if err := c.format(ctx, n); err != nil {
			return err
		}
	}
	for _, n := range c.nodes {
		if err := c.launch(n); err != nil {
			return err
		}
	}
	return c.awaitReady(ctx, c.opts.Nodes)
}

// Brokers returns the bootstrap addresses ("127.0.0.1:port") of every node,
// running or not.
func (c *Cluster) Brokers() []string {
	out := make([]string, len(c.nodes))
	for i, n := range c.nodes {
		out[i] = n.addr()
	}
	return out
}

// Nodes returns the number of nodes.
func (c *Cluster) Nodes() int { return len(c.nodes) }

// NodeID returns the Kafka node id (broker id) of the node at index i.
func (c *Cluster) NodeID(i int) int32 { return int32(c.nodes[i].id) }

// IndexOf returns the index of the node with Kafka node id id, or -1.
func (c *Cluster) IndexOf(id int32) int {
	for i, n := range c.nodes {
		if int32(n.id) == id {
			return i
		}
	}
	return -1
}

// Kill kills node i with SIGKILL (no controlled shutdown) and waits until
// its process is gone. Restart brings it back with its data.
func (c *Cluster) Kill(i int) error { return c.nodes[i].stop(syscall.SIGKILL, 30*time.Second) }

// Stop stops node i with SIGTERM (a controlled shutdown that moves its
// leaderships away first) and waits up to a minute, then kills it.
func (c *Cluster) Stop(i int) error {
	n := c.nodes[i]
	if err := n.stop(syscall.SIGTERM, time.Minute); err != nil {
		return n.stop(syscall.SIGKILL, 30*time.Second)
	}
	return nil
}

// Restart starts node i again after Kill or Stop, on the same ports and
// data, and waits until every running node is registered again.
func (c *Cluster) Restart(ctx context.Context, i int) error {
	if err := c.launch(c.nodes[i]); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, c.opts.StartTimeout)
	defer cancel()
	return c.awaitReady(ctx, c.running())
}

// Running reports whether node i's process runs.
func (c *Cluster) Running(i int) bool { return c.nodes[i].running() }

// Pid returns node i's process id, or 0 when it does not run.
func (c *Cluster) Pid(i int) int {
	n := c.nodes[i]
	cmd, _ := n.current()
	if cmd == nil || !n.running() {
		return 0
	}
	return cmd.Process.Pid
}

// Log returns the last lines of node i's server log, for test failures.
func (c *Cluster) Log(i int, lines int) string {
	return tail(filepath.Join(c.nodes[i].dir, "server.log"), lines)
}

// Close kills every node, stops the watchdog and removes the cluster's
// directory. It is safe to call more than once.
func (c *Cluster) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	for _, n := range c.nodes {
		_ = n.stop(syscall.SIGKILL, 30*time.Second)
	}
	if c.watchdog != nil {
		_ = c.watchdog.Process.Kill()
		_ = c.watchdog.Wait()
	}
	return os.RemoveAll(c.dir)
}

func (c *Cluster) running() int {
	k := 0
	for _, n := range c.nodes {
		if n.running() {
			k++
		}
	}
	return k
}

// properties returns node n's server.properties, in a stable order.
func (c *Cluster) properties(n *node) map[string]string {
	voters := make([]string, len(c.nodes))
	for i, m := range c.nodes {
		voters[i] = fmt.Sprintf("%d@127.0.0.1:%d", m.id, m.ctrlPort)
	}
	rf := strconv.Itoa(min(3, len(c.nodes)))
	isr := strconv.Itoa(min(2, len(c.nodes)))
	p := map[string]string{
		"process.roles":                                    "broker,controller",
		"node.id":                                          strconv.Itoa(n.id),
		"controller.quorum.voters":                         strings.Join(voters, ","),
		"listeners":                                        fmt.Sprintf("PLAINTEXT://127.0.0.1:%d,CONTROLLER://127.0.0.1:%d", n.port, n.ctrlPort),
		"advertised.listeners":                             fmt.Sprintf("PLAINTEXT://127.0.0.1:%d", n.port),
		"controller.listener.names":                        "CONTROLLER",
		"listener.security.protocol.map":                   "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
		"inter.broker.listener.name":                       "PLAINTEXT",
		"log.dirs":                                         filepath.Join(n.dir, "data"),
		"auto.create.topics.enable":                        "false",
		"group.initial.rebalance.delay.ms":                 "0",
		"group.min.session.timeout.ms":                     "200",
		"num.partitions":                                   "1",
		"default.replication.factor":                       rf,
		"offsets.topic.replication.factor":                 rf,
		"offsets.topic.num.partitions":                     "4",
		"transaction.state.log.replication.factor":         rf,
		"transaction.state.log.min.isr":                    isr,
		"transaction.state.log.num.partitions":             "4",
		"share.coordinator.state.topic.replication.factor": rf,
		"share.coordinator.state.topic.min.isr":            isr,
		"share.coordinator.state.topic.num.partitions":     "1",
		"num.network.threads":                              "2",
		"num.io.threads":                                   "4",
		"background.threads":                               "2",
		"log.cleaner.enable":                               "false",
		"controlled.shutdown.enable":                       "true",
		"controller.quorum.election.timeout.ms":            "1000",
		"controller.quorum.fetch.timeout.ms":               "2000",
		"broker.session.timeout.ms":                        "3000",
		"broker.heartbeat.interval.ms":                     "500",
		"replica.lag.time.max.ms":                          "5000",
		"offsets.commit.timeout.ms":                        "5000",
		"delete.topic.enable":                              "true",
	}
	if len(c.opts.SASLUsers) > 0 {
		users := []string{fmt.Sprintf("username=%q password=%q user_%s=%q", AdminUser, AdminUser, AdminUser, AdminUser)}
		for u, pw := range c.opts.SASLUsers {
			users = append(users, fmt.Sprintf("user_%s=%q", u, pw))
		}
		sort.Strings(users[1:])
		p["listener.security.protocol.map"] = "PLAINTEXT:SASL_PLAINTEXT,CONTROLLER:PLAINTEXT"
		p["sasl.enabled.mechanisms"] = "PLAIN"
		p["sasl.mechanism.inter.broker.protocol"] = "PLAIN"
		p["listener.name.plaintext.plain.sasl.jaas.config"] = "org.apache.kafka.common.security.plain.PlainLoginModule required " + strings.Join(users, " ") + ";"
	}
	for k, v := range c.opts.Properties {
		p[k] = v
	}
	return p
}

// AdminUser is the SASL user (its password the same) of the nodes and of
// Start's readiness checks when Options.SASLUsers is set.
const AdminUser = "once-admin"

func (c *Cluster) writeConfig(n *node) error {
	if err := os.MkdirAll(filepath.Join(n.dir, "data"), 0o755); err != nil {
		return err
	}
	props := c.properties(n)
	keys := make([]string, 0, len(props))
	for k := range props {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, "%s=%s\n", k, props[k])
	}
	if err := os.WriteFile(filepath.Join(n.dir, "server.properties"), []byte(b.String()), 0o644); err != nil {
		return err
	}
	// Warnings and the lines that tell a person what the node did: the
	// full INFO log is ~1500 lines per start.
	log4j := fmt.Sprintf(`status = error
appender.file.type = File
appender.file.name = file
appender.file.fileName = %s
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%%d] %%p %%m (%%c)%%n
rootLogger.level = warn
rootLogger.appenderRef.file.ref = file
logger.raft.name = kafka.server.KafkaRaftServer
logger.raft.level = info
logger.broker.name = kafka.server.BrokerServer
logger.broker.level = info
`, filepath.Join(n.dir, "server.log"))
	return os.WriteFile(filepath.Join(n.dir, "log4j2.properties"), []byte(log4j), 0o644)
}

// javaArgs returns the JVM command line running class with args on node n.
func (c *Cluster) javaArgs(n *node, heapMB int, class string, args ...string) []string {
	a := []string{
		"-Xms" + strconv.Itoa(min(heapMB, 64)) + "m",
		"-Xmx" + strconv.Itoa(heapMB) + "m",
		"-XX:+UseSerialGC",
		"-XX:-UsePerfData",
		"-Xss512k",
		"-Djava.awt.headless=true",
		"-Dlog4j2.configurationFile=" + filepath.Join(n.dir, "log4j2.properties"),
		"-cp", filepath.Join(c.libs, "*"),
	}
	if !c.opts.FullJIT {
		a = append(a, "-XX:TieredStopAtLevel=1")
	}
	return append(append(a, class), args...)
}

// format writes the node's KRaft storage metadata (the cluster id).
func (c *Cluster) format(ctx context.Context, n *node) error {
	cmd := exec.CommandContext(ctx, "java", c.javaArgs(n, 128, "kafka.tools.StorageTool",
		"format", "--ignore-formatted", "--cluster-id="+c.clusterID, "-c", filepath.Join(n.dir, "server.properties"))...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("kafkatemp: format node %d: %w: %s", n.id, err, strings.TrimSpace(out.String()))
	}
	return nil
}

// launch starts node n's JVM in a process group of its own (an interrupt of
// the test does not kill it before Close; the watchdog does if the test
// process dies) and records its pid for the watchdog.
func (c *Cluster) launch(n *node) error {
	if n.running() {
		return fmt.Errorf("kafkatemp: node %d already runs", n.id)
	}
	out, err := os.OpenFile(filepath.Join(n.dir, "stdout.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer out.Close()
	cmd := exec.Command("java", c.javaArgs(n, c.opts.HeapMB, "kafka.Kafka", filepath.Join(n.dir, "server.properties"))...)
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("kafkatemp: start node %d: %w", n.id, err)
	}
	if err := os.WriteFile(filepath.Join(n.dir, "pid"), []byte(strconv.Itoa(cmd.Process.Pid)), 0o644); err != nil {
		_ = cmd.Process.Kill()
		return err
	}
	exited := make(chan struct{})
	n.mu.Lock()
	n.cmd, n.exited, n.stopped = cmd, exited, false
	n.mu.Unlock()
	go func() {
		err := cmd.Wait()
		n.mu.Lock()
		n.waitErr = err
		n.mu.Unlock()
		close(exited)
	}()
	return nil
}

func (n *node) addr() string { return "127.0.0.1:" + strconv.Itoa(n.port) }

// current returns the node's process and the channel closed when it ends
// (nil, nil before the first launch).
func (n *node) current() (*exec.Cmd, chan struct{}) {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.cmd, n.exited
}

func (n *node) running() bool {
	_, exited := n.current()
	if exited == nil {
		return false
	}
	select {
	case <-exited:
		return false
	default:
		return true
	}
}

// stop sends sig to the node's process and waits up to bound for it to end.
func (n *node) stop(sig syscall.Signal, bound time.Duration) error {
	n.mu.Lock()
	cmd, exited := n.cmd, n.exited
	n.stopped = true
	n.mu.Unlock()
	if cmd == nil || exited == nil {
		return nil
	}
	select {
	case <-exited:
		return nil
	default:
	}
	_ = cmd.Process.Signal(sig)
	select {
	case <-exited:
		return nil
	case <-time.After(bound):
		return fmt.Errorf("kafkatemp: node %d did not end within %v of %v", n.id, bound, sig)
	}
}

// awaitReady waits until want brokers are registered in the cluster's
// metadata, as seen from a running node, and the group coordinator answers.
func (c *Cluster) awaitReady(ctx context.Context, want int) error {
	var last error
	for {
		for _, n := range c.nodes {
			_, exited := n.current()
			if exited == nil {
				continue
			}
			select {
			case <-exited:
				if !c.closedOrStopping() && !n.wasStopped() {
					return fmt.Errorf("kafkatemp: node %d exited during start-up (%w); its log:\n%s",
						n.id, n.exitErr(), tail(filepath.Join(n.dir, "server.log"), 30)+tail(filepath.Join(n.dir, "stdout.log"), 10))
				}
			default:
			}
		}
		if last = c.probe(want); last == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("kafkatemp: cluster not ready: %w (last probe: %w)", ctx.Err(), last)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func (c *Cluster) closedOrStopping() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.closed
}

// probe asks a running node for the cluster's metadata and the group
// coordinator of a probe group.
func (c *Cluster) probe(want int) error {
	var addrs []string
	for _, n := range c.nodes {
		if n.running() {
			addrs = append(addrs, n.addr())
		}
	}
	if len(addrs) == 0 {
		return errors.New("no node runs")
	}
	sc := ProbeConfig()
	if len(c.opts.SASLUsers) > 0 {
		sc.Net.SASL.Enable = true
		sc.Net.SASL.User, sc.Net.SASL.Password = AdminUser, AdminUser
	}
	client, err := sarama.NewClient(addrs, sc)
	if err != nil {
		return err
	}
	defer client.Close()
	if got := len(client.Brokers()); got < want {
		return fmt.Errorf("%d of %d brokers registered", got, want)
	}
	if _, err := client.Controller(); err != nil {
		return fmt.Errorf("controller: %w", err)
	}
	return nil
}

// ProbeConfig is a sarama configuration for short administrative calls
// to a throwaway cluster: quick retries and timeouts.
func ProbeConfig() *sarama.Config {
	sc := sarama.NewConfig()
	sc.Version = sarama.V3_9_0_0
	sc.Net.DialTimeout = 2 * time.Second
	sc.Net.ReadTimeout = 5 * time.Second
	sc.Net.WriteTimeout = 5 * time.Second
	sc.Metadata.Retry.Max = 1
	sc.Metadata.Retry.Backoff = 50 * time.Millisecond
	return sc
}

// watchdogScript waits for process $1 to end, then kills every node whose
// pid file lies under $2 (only if that pid still runs a Kafka JVM) and
// removes $2. It tests /proc rather than kill -0.
const watchdogScript = `while [ -d "/proc/$1" ]; do sleep 0.5; done
for f in "$2"/node-*/pid; do
  [ -f "$f" ] || continue
  p=$(cat "$f")
  if grep -q kafka.Kafka "/proc/$p/cmdline" 2>/dev/null; then kill -9 "$p" 2>/dev/null; fi
done
sleep 0.5
rm -rf "$2"`

// startWatchdog starts a shell, in a process group of its own, that kills
// the nodes and removes the directory if this process dies before Close.
func (c *Cluster) startWatchdog() error {
	cmd := exec.Command("/bin/sh", "-c", watchdogScript, "kafkatemp-watchdog", strconv.Itoa(os.Getpid()), c.dir)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("kafkatemp: watchdog: %w", err)
	}
	c.watchdog = cmd
	return nil
}

// Libs returns the directory of the Kafka release's jars: $ONCE_KAFKA_LIBS,
// else what scripts/kafka.sh fetched into $ONCE_CACHE_DIR (default
// ~/.cache/once) for $KAFKA_VERSION (default Version). It returns an
// error saying how to fetch it when neither holds the jars.
func Libs() (string, error) {
	if d := os.Getenv("ONCE_KAFKA_LIBS"); d != "" {
		if jars, _ := filepath.Glob(filepath.Join(d, "kafka_2.13-*.jar")); len(jars) == 0 {
			return "", fmt.Errorf("kafkatemp: ONCE_KAFKA_LIBS=%s holds no kafka_2.13 jar", d)
		}
		return d, nil
	}
	cache := os.Getenv("ONCE_CACHE_DIR")
	if cache == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			return "", fmt.Errorf("kafkatemp: no cache directory: %w", err)
		}
		cache = filepath.Join(home, ".cache", "once")
	}
	version := os.Getenv("KAFKA_VERSION")
	if version == "" {
		version = Version
	}
	dir := filepath.Join(cache, "kafka-"+version, "libs")
	if _, err := os.Stat(filepath.Join(dir, ".complete")); err != nil {
		return "", fmt.Errorf("kafkatemp: Apache Kafka %s is not fetched (no %s): run scripts/kafka.sh fetch (make test does)", version, dir)
	}
	return dir, nil
}

// Version is the Apache Kafka release scripts/kafka.sh fetches by default
// and Libs looks for (a test keeps the two equal).
const Version = "4.1.1"

// newClusterID returns a random cluster id as Kafka writes them: 16 bytes
// in URL-safe base64. One that starts with "-" would be read as an option
// by the storage tool's argument parser (one id in 64, a start-up that
// failed now and then): such ids are drawn again, and the id is passed as
// --cluster-id=ID besides.
func newClusterID() string {
	for {
		var b [16]byte
		_, _ = rand.Read(b[:])
		if id := base64.RawURLEncoding.EncodeToString(b[:]); id[0] != '-' {
			return id
		}
	}
}

// freePort picks the server's port below the ephemeral range, so that a
// restart finds it free again (internal/freeport).
func freePort() (int, error) { return freeport.Pick() }

// tail returns the last n lines of file, or a note that it cannot be read.
func tail(file string, n int) string {
	b, err := os.ReadFile(file)
	if err != nil {
		return fmt.Sprintf("(%s: %v)\n", file, err)
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n") + "\n"
}

// Freeze stops node i with SIGSTOP: its process stays, its connections stay
// open, and nothing answers (a hung broker, a long GC pause). It returns
// once every thread of the node has stopped (see stopAndWait). Thaw
// resumes it.
func (c *Cluster) Freeze(i int) error {
	p, err := c.process(i)
	if err != nil {
		return err
	}
	return stopAndWait(p, freezeWait)
}

// Thaw resumes node i after Freeze with SIGCONT.
func (c *Cluster) Thaw(i int) error {
	p, err := c.process(i)
	if err != nil {
		return err
	}
	return p.Signal(syscall.SIGCONT)
}

// process returns node i's running process.
func (c *Cluster) process(i int) (*os.Process, error) {
	cmd, _ := c.nodes[i].current()
	if cmd == nil || !c.nodes[i].running() {
		return nil, fmt.Errorf("kafkatemp: node %d does not run", c.nodes[i].id)
	}
	return cmd.Process, nil
}
