package kafkatemp_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"

	"github.com/onceco/once/internal/kafkatemp"
	"github.com/onceco/once/internal/kafkatest"
)

// A node killed with SIGKILL comes back with its data: a record produced
// before the kill is read after the restart, and auto-creation is off. Its
// files are where Options.Dir says.
func TestKillRestartKeepsData(t *testing.T) {
	began := time.Now()
	parent := t.TempDir()
	c := kafkatest.Start(t, kafkatemp.Options{Dir: parent})
	logs, err := filepath.Glob(filepath.Join(parent, "once-kafka-*", "node-1", "data"))
	require.NoError(t, err)
	require.Len(t, logs, 1, "the node's log directory is under Options.Dir")
	t.Logf("one node ready in %v, RSS %s", time.Since(began), rss(c.Pid(0)))
	sc := kafkatemp.ProbeConfig()
	sc.Producer.Return.Successes = true
	admin, err := sarama.NewClusterAdmin(c.Brokers(), sc)
	require.NoError(t, err)
	require.NoError(t, admin.CreateTopic("t", &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1}, false))
	require.NoError(t, admin.Close())

	p, err := sarama.NewSyncProducer(c.Brokers(), sc)
	require.NoError(t, err)
	_, off, err := p.SendMessage(&sarama.ProducerMessage{Topic: "t", Value: sarama.StringEncoder("before")})
	require.NoError(t, err)
	_, _, err = p.SendMessage(&sarama.ProducerMessage{Topic: "no-such-topic", Value: sarama.StringEncoder("x")})
	require.ErrorIs(t, err, sarama.ErrUnknownTopicOrPartition, "auto.create.topics.enable must be off")
	require.NoError(t, p.Close())

	pid := c.Pid(0)
	require.NotZero(t, pid)
	require.NoError(t, c.Kill(0))
	require.False(t, c.Running(0))
	_, err = os.Stat("/proc/" + strconv.Itoa(pid))
	require.True(t, os.IsNotExist(err), "the killed JVM is gone")

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	began = time.Now()
	require.NoError(t, c.Restart(ctx, 0))
	t.Logf("restarted in %v", time.Since(began))
	client, err := sarama.NewClient(c.Brokers(), sc)
	require.NoError(t, err)
	defer client.Close()
	hwm, err := client.GetOffset("t", 0, sarama.OffsetNewest)
	require.NoError(t, err)
	require.Equal(t, off+1, hwm)
}

// A process that dies without Close leaves no broker behind: the watchdog
// kills the node. The child is this test binary, started with an
// environment variable that makes it start a cluster, print the node's pid
// and exit without closing it.
func TestWatchdogStopsBrokerOfDeadProcess(t *testing.T) {
	if os.Getenv("KAFKATEMP_CHILD") == "1" {
		c, err := kafkatemp.Start(context.Background(), kafkatemp.Options{})
		if err != nil {
			os.Stdout.WriteString("error " + err.Error() + "\n")
			os.Exit(2)
		}
		os.Stdout.WriteString(strconv.Itoa(c.Pid(0)) + "\n")
		os.Exit(0) // no Close
	}
	if _, err := kafkatemp.Libs(); err != nil {
		kafkatest.Start(t, kafkatemp.Options{}) // skips or fails with the reason
	}
	cmd := exec.Command(os.Args[0], "-test.run", "^TestWatchdogStopsBrokerOfDeadProcess$")
	cmd.Env = append(os.Environ(), "KAFKATEMP_CHILD=1")
	out, err := cmd.Output()
	require.NoError(t, err, string(out))
	pid, err := strconv.Atoi(string(out[:len(out)-1]))
	require.NoError(t, err, string(out))
	require.Eventually(t, func() bool {
		_, err := os.Stat("/proc/" + strconv.Itoa(pid))
		return os.IsNotExist(err)
	}, 20*time.Second, 100*time.Millisecond, "the broker of a dead test process must be killed by the watchdog")
}

// Without the fetched release, Start says how to fetch it.
func TestStartWithoutReleaseSaysHowToFetch(t *testing.T) {
	t.Setenv("ONCE_KAFKA_LIBS", "")
	t.Setenv("ONCE_CACHE_DIR", t.TempDir())
	_, err := kafkatemp.Start(context.Background(), kafkatemp.Options{})
	require.ErrorContains(t, err, "scripts/kafka.sh fetch")
}

// The script and the package pin the same release.
func TestVersionMatchesScript(t *testing.T) {
	out, err := exec.Command("../../scripts/kafka.sh", "version").Output()
	require.NoError(t, err)
	require.Equal(t, kafkatemp.Version+"\n", string(out))
}

// rss returns the resident set of process pid, as /proc reports it.
func rss(pid int) string {
	status, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return err.Error()
	}
	for _, line := range strings.Split(string(status), "\n") {
		if strings.HasPrefix(line, "VmRSS:") {
			return strings.TrimSpace(strings.TrimPrefix(line, "VmRSS:"))
		}
	}
	return "unknown"
}

// Three nodes form one cluster: every broker is registered, and a topic
// with replication factor 3 gets a leader per partition.
func TestThreeNodes(t *testing.T) {
	began := time.Now()
	c := kafkatest.Start(t, kafkatemp.Options{Nodes: 3})
	t.Logf("three nodes ready in %v, RSS %s, %s, %s", time.Since(began), rss(c.Pid(0)), rss(c.Pid(1)), rss(c.Pid(2)))
	sc := kafkatemp.ProbeConfig()
	admin, err := sarama.NewClusterAdmin(c.Brokers(), sc)
	require.NoError(t, err)
	defer admin.Close()
	require.NoError(t, admin.CreateTopic("t", &sarama.TopicDetail{NumPartitions: 3, ReplicationFactor: 3}, false))
	client, err := sarama.NewClient(c.Brokers(), sc)
	require.NoError(t, err)
	defer client.Close()
	require.Len(t, client.Brokers(), 3)
	require.Eventually(t, func() bool {
		if client.RefreshMetadata("t") != nil {
			return false
		}
		for p := range int32(3) {
			if r, err := client.Replicas("t", p); err != nil || len(r) != 3 {
				return false
			}
		}
		return true
	}, 30*time.Second, 50*time.Millisecond)
}
