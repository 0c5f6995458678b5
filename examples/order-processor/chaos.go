package main

// The chaos driver (make chaos): runs this program's serve command, built
// with -tags chaos, as several processes against a broker and a throwaway
// PostgreSQL server, injects faults while they work (SIGKILLs at random
// moments, every crash point of the consumer, PostgreSQL restarts, broker
// connection cuts, members leaving and joining a Kafka group), then counts
// the business effects of every event sent: none lost, none doubled, every
// poison message dead-lettered.

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/onceco/once/brokers/kafka"
	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/kafkatemp"
	"github.com/onceco/once/internal/netcut"
	"github.com/onceco/once/internal/pgtemp"
)

// crashExitCode is the exit status of a process killed by a crash point
// (consumer/crashpoint_chaos.go).
const crashExitCode = 86

// crashPointNames are the consumer's crash points (consumer.CrashPoints,
// which exists only in the chaos build).
var crashPointNames = []string{"after-claim", "after-handler", "after-commit", "after-dead-letter", "mid-batch"}

// ChaosConfig says what a chaos run does.
type ChaosConfig struct {
	Broker  string // kafka (kfake), apache-kafka or amqp
	AMQPURL string // amqp: the broker

	Orders      int   // orders of the generated traffic
	Seed        int64 // traffic and fault seed
	Kills       int   // SIGKILLs of a member at a random moment
	CrashPoints bool  // one crash at each crash point
	PGRestarts  int   // PostgreSQL stop/restart while the members run
	Cuts        int   // broker connection cuts
	Members     int   // processes consuming at once
	Rebalances  int   // kafka: a member killed while another joins
	RelayKills  int   // SIGKILLs of the member whose outbox relay leads (chaos_hops.go)
	// SchemaChanges: changes of the type of a column the handlers read
	// (chaos_schema.go).
	SchemaChanges int
	// OffsetsInDatabase (kafka): the members keep offsets in PostgreSQL,
	// and one fault deletes the group with its offsets (chaos_offsets.go).
	OffsetsInDatabase bool

	Exe    string    // the order-processor built with -tags chaos; empty: built here
	Logs   string    // directory of the members' logs; empty: a temporary one
	Output io.Writer // progress lines; nil: none
}

// ChaosResult is what a run counted.
type ChaosResult struct {
	Broker  string `json:"broker"`
	Seed    int64  `json:"seed"`
	Command string `json:"command,omitempty"`

	Sent         int            `json:"sent"`
	SentByKind   map[string]int `json:"sent_by_kind"`
	UniqueEvents int            `json:"unique_events"`
	EffectsOnce  int            `json:"effects_once"`
	Lost         int            `json:"lost"`
	Doubled      int            `json:"doubled"`
	LostIDs      []string       `json:"lost_ids,omitempty"`
	DoubledIDs   []string       `json:"doubled_ids,omitempty"`
	// DuplicatesSkipped is what the members reported of their order
	// consumer (not the shipping one); a killed member takes its last few
	// seconds of counts with it, so it is a lower bound.
	DuplicatesSkipped uint64 `json:"duplicates_skipped_reported"`
	Processed         int64  `json:"processed_events"`
	// Unclaimed counts the valid events with no processed_events row (a
	// lost event, or a claim recorded under another id); StrayClaims the
	// processed_events rows of no event handled (an id never sent, or a
	// poison message's). The ids: up to 20 of each.
	Unclaimed          int      `json:"unclaimed"`
	StrayClaims        int      `json:"stray_claims"`
	UnclaimedIDs       []string `json:"unclaimed_ids,omitempty"`
	StrayClaimIDs      []string `json:"stray_claim_ids,omitempty"`
	Poison             int      `json:"poison"`
	PoisonDeadLettered int      `json:"poison_dead_lettered"`
	PoisonMissing      []string `json:"poison_missing,omitempty"`
	// PoisonCrashLoop counts poison dead-lettered with kind crash-loop
	// instead of its own: it was in flight at CrashGuard.MaxCrashes (3) process
	// deaths, e.g. a handler failure retried for seconds across kills.
	PoisonCrashLoop int            `json:"poison_crash_loop"`
	DLQRecords      int            `json:"dlq_records"`
	DLQByKind       map[string]int `json:"dlq_records_by_kind"`
	DLQIDsByKind    map[string]int `json:"dlq_event_ids_by_kind"`
	Replayed        int            `json:"replayed"`
	// CrashLoopReplayed counts the valid events among Replayed that had
	// been dead-lettered as crash-loop (in flight at 3 process deaths).
	CrashLoopReplayed int    `json:"crash_loop_replayed"`
	OrdersCheck       string `json:"orders_check"`

	// Faults counts the faults injected, by kind; FaultsScheduled those
	// the schedule had. A fault that hit nothing (a kill that found its
	// member exited, a cut with no connection, a crash point not reached)
	// is not injected, and the verdict fails.
	Faults          map[string]int `json:"faults"`
	FaultsScheduled map[string]int `json:"faults_scheduled"`
	CrashPoints     map[string]int `json:"crash_points_reached"`
	Members         int            `json:"members"`
	Starts          int            `json:"member_starts"`
	// MembersEndedByThemselves lists the member processes that ended
	// neither by the driver's SIGKILL, nor with status 0 after its SIGTERM,
	// nor at an armed crash point: e.g. a consumer that gave up during a
	// PostgreSQL restart instead of retrying. The verdict fails.
	MembersEndedByThemselves []string `json:"members_ended_by_themselves,omitempty"`
	// DeadMembersRemoved counts the members of a group that the embedded
	// broker kept after their process died and the driver removed
	// (chaos_kfake.go); always 0 on Apache Kafka and RabbitMQ.
	DeadMembersRemoved int      `json:"dead_members_removed,omitempty"`
	Elapsed            string   `json:"elapsed"`
	Verdict            string   `json:"verdict"`
	Problems           []string `json:"problems,omitempty"`

	Hop2 *Hop2Result `json:"hop2,omitempty"` // the second hop: outbox, relay, shipping (chaos_hops.go)
}

// Pass reports whether the run's verdict is a pass.
func (r *ChaosResult) Pass() bool { return len(r.Problems) == 0 }

func chaosMain(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("order-processor chaos", flag.ContinueOnError)
	fs.SetOutput(stderr)
	brokers := fs.String("broker", envOr("BROKER", "kafka"), "kafka (kfake), apache-kafka (three Apache Kafka nodes; scripts/kafka.sh fetch), amqp, or all (amqp needs AMQP_URL)")
	cfg := ChaosConfig{CrashPoints: true}
	fs.IntVar(&cfg.Orders, "orders", 3000, "orders of the generated traffic (about two messages each)")
	fs.Int64Var(&cfg.Seed, "seed", 0, "traffic and fault seed (0: from the clock)")
	fs.IntVar(&cfg.Kills, "kills", 20, "SIGKILLs of a member at a random moment")
	fs.IntVar(&cfg.PGRestarts, "pg-restarts", 2, "PostgreSQL restarts while the members run")
	fs.IntVar(&cfg.Cuts, "cuts", 5, "cuts of every broker connection")
	fs.IntVar(&cfg.Members, "members", 3, "member processes consuming at once")
	fs.IntVar(&cfg.Rebalances, "rebalances", 3, "kafka: members killed while another joins the group")
	fs.IntVar(&cfg.RelayKills, "relay-kills", 3, "SIGKILLs of the member whose outbox relay leads")
	fs.IntVar(&cfg.SchemaChanges, "schema-changes", 2, "changes of the type of a column the handlers read (orders.status), as a migration makes")
	noCrash := fs.Bool("no-crash-points", false, "skip the crash points")
	offsetsFlag(fs, &cfg)
	fs.StringVar(&cfg.Exe, "exe", "", "order-processor built with -tags chaos (empty: build it)")
	fs.StringVar(&cfg.Logs, "logs", "", "directory for the members' logs (empty: a temporary one)")
	jsonFile := fs.String("json", "", "write the results as JSON to this file")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	cfg.CrashPoints = !*noCrash
	cfg.Output = stderr
	cfg.AMQPURL = os.Getenv("AMQP_URL")
	if cfg.Seed == 0 {
		cfg.Seed = time.Now().UnixNano()%900000 + 100000
	}
	var list []string
	switch *brokers {
	case "all":
		list = []string{"kafka", "apache-kafka", "amqp"}
	case "kafka", "apache-kafka", "amqp":
		list = []string{*brokers}
	default:
		fmt.Fprintf(stderr, "order-processor chaos: -broker %q: want kafka, apache-kafka, amqp or all\n", *brokers)
		return 2
	}
	if cfg.Exe == "" {
		// One build for every broker's run.
		dir, err := os.MkdirTemp("", "once-chaos-exe-")
		if err != nil {
			fmt.Fprintln(stderr, "order-processor chaos:", err)
			return 1
		}
		defer os.RemoveAll(dir)
		if cfg.Exe, err = buildChaosExe(ctx, dir); err != nil {
			fmt.Fprintln(stderr, "order-processor chaos:", err)
			return 1
		}
	}
	command := "order-processor chaos " + strings.Join(args, " ")
	var results []*ChaosResult
	code := 0
	for _, b := range list {
		c := cfg
		c.Broker = b
		res, err := RunChaos(ctx, c)
		if err != nil {
			fmt.Fprintf(stderr, "order-processor chaos (%s): %v\n", b, err)
			return 1
		}
		res.Command = command
		res.Print(stdout)
		results = append(results, res)
		if !res.Pass() {
			code = 1
		}
	}
	if *jsonFile != "" {
		data, _ := json.MarshalIndent(results, "", "  ")
		if err := os.WriteFile(*jsonFile, append(data, '\n'), 0o644); err != nil {
			fmt.Fprintln(stderr, "order-processor chaos:", err)
			return 1
		}
	}
	return code
}

// Print writes the result as a table.
func (r *ChaosResult) Print(w io.Writer) {
	fmt.Fprintf(w, "\nchaos run: %s, seed %d, %d members, %s\n", r.Broker, r.Seed, r.Members, r.Elapsed)
	fmt.Fprintf(w, "%-28s %s of %s scheduled\n", "faults", kindList(r.Faults), kindList(r.FaultsScheduled))
	fmt.Fprintf(w, "%-28s %s\n", "crash points reached", kindList(r.CrashPoints))
	fmt.Fprintf(w, "%-28s %d\n", "member starts", r.Starts)
	for _, e := range r.MembersEndedByThemselves {
		fmt.Fprintf(w, "  %s\n", e)
	}
	if r.DeadMembersRemoved > 0 {
		fmt.Fprintf(w, "%-28s %d (kept by the embedded broker past their session; see chaos_kfake.go)\n", "dead members removed", r.DeadMembersRemoved)
	}
	fmt.Fprintf(w, "%-28s %d\n", "sent", r.Sent)
	for _, k := range kindOrder {
		if n := r.SentByKind[k]; n > 0 {
			fmt.Fprintf(w, "  %-26s %d\n", k, n)
		}
	}
	fmt.Fprintf(w, "%-28s %d\n", "unique valid events", r.UniqueEvents)
	fmt.Fprintf(w, "%-28s %d\n", "business effect once", r.EffectsOnce)
	fmt.Fprintf(w, "%-28s %d (%d valid events without one, %d of no event handled)\n", "processed_events rows", r.Processed, r.Unclaimed, r.StrayClaims)
	fmt.Fprintf(w, "%-28s %d (reported by the members; a killed member's last seconds are not counted)\n", "duplicates skipped >=", r.DuplicatesSkipped)
	fmt.Fprintf(w, "%-28s %d records %s, event ids %s\n", "DLQ", r.DLQRecords, kindList(r.DLQByKind), kindList(r.DLQIDsByKind))
	fmt.Fprintf(w, "%-28s %d of %d", "poison dead-lettered", r.PoisonDeadLettered, r.Poison)
	if r.PoisonCrashLoop > 0 {
		fmt.Fprintf(w, " (%d as crash-loop: in flight at 3 process deaths)", r.PoisonCrashLoop)
	}
	fmt.Fprintln(w)
	if r.Replayed > 0 {
		fmt.Fprintf(w, "%-28s %d (dead-lettered before their order existed", "replayed", r.Replayed)
		if r.CrashLoopReplayed > 0 {
			fmt.Fprintf(w, ", or valid events dead-lettered as crash-loop: %d", r.CrashLoopReplayed)
		}
		fmt.Fprintln(w, ")")
	}
	fmt.Fprintf(w, "%-28s %s\n", "orders and ledger", r.OrdersCheck)
	fmt.Fprintf(w, "%-28s %d\n", "lost", r.Lost)
	fmt.Fprintf(w, "%-28s %d\n", "doubled", r.Doubled)
	if r.Hop2 != nil {
		r.Hop2.print(w)
	}
	for _, p := range r.Problems {
		fmt.Fprintf(w, "  problem: %s\n", p)
	}
	fmt.Fprintf(w, "verdict: %s\n", r.Verdict)
}

// chaosRun is one run's state.
type chaosRun struct {
	cfg      ChaosConfig
	o        *options
	rng      *rand.Rand
	pg       *pgtemp.Server
	pool     *pgxpool.Pool
	plan     *Plan
	perFault int // orders generated before each fault
	batches  int // traffic batches generated so far
	// schemaChanges counts the changes of orders.status's type so far.
	schemaChanges int
	pub           publisher
	lag           func(context.Context) (int64, error)
	dlq           func() ([]deadLetter, error)
	cut           func() int
	real          *kafkatemp.Cluster // apache-kafka: the three nodes
	logs          string
	// memberAMQP is the URL the members use: through the cutting proxy.
	memberAMQP string
	closers    []func()

	mu      sync.Mutex
	members []*member
	nextID  int
	starts  int
	dups    uint64
	faults  map[string]int // injected, by kind
	// scheduled counts the faults of the schedule by kind.
	scheduled map[string]int
	crashes   map[string]int
	extra     int // poison added for after-dead-letter
	// exitedAt is when each member that exited did, by member id (kept
	// after forget).
	exitedAt map[int]time.Time
	// selfEnded lists the members that ended when the driver did not end
	// them (member.endedByItself).
	selfEnded []string
	// reaper removes dead members the embedded broker keeps (kfake only).
	reaper *deadMemberReaper
}

// member is one consumer process.
type member struct {
	id     int
	cmd    *exec.Cmd
	out    string // its stdout and stderr file
	exited chan struct{}
	code   int
	// crashPoint is the crash point armed in it (its crashEnv:
	// ONCE_CRASH_POINT or ONCE_RELAY_CRASH), if any: it may exit with
	// crashExitCode.
	crashPoint string
	// stopping is set when the driver sends SIGTERM, hung when the
	// member did not exit within a minute of it.
	stopping, hung atomic.Bool
}

// endedByItself says how m ended when the driver did not end it, or
// returns "": the driver ends a member by SIGKILL, by SIGTERM (exit status
// 0), or at its armed crash point (exit status 86). Any other end is a
// failure the member should have ridden out.
func (m *member) endedByItself() string {
	ws, _ := m.cmd.ProcessState.Sys().(syscall.WaitStatus)
	switch {
	case m.hung.Load():
		return "did not stop within a minute of SIGTERM"
	case ws.Signaled() && ws.Signal() == syscall.SIGKILL:
		return ""
	case ws.Exited() && ws.ExitStatus() == 0 && m.stopping.Load():
		return ""
	case ws.Exited() && ws.ExitStatus() == crashExitCode && m.crashPoint != "":
		return ""
	case m.stopping.Load():
		return "ended with " + m.cmd.ProcessState.String() + " after SIGTERM"
	}
	return "ended by itself with " + m.cmd.ProcessState.String()
}

func (r *chaosRun) logf(format string, args ...any) {
	if r.cfg.Output != nil {
		fmt.Fprintf(r.cfg.Output, "chaos %s: "+format+"\n", append([]any{r.cfg.Broker}, args...)...)
	}
}

// RunChaos runs one chaos run and counts its outcome. An error means the
// run could not be carried out; a failed verdict is in the result.
func RunChaos(ctx context.Context, cfg ChaosConfig) (res *ChaosResult, err error) {
	start := time.Now()
	if cfg.Members < 1 {
		cfg.Members = 1
	}
	r := &chaosRun{cfg: cfg, rng: rand.New(rand.NewSource(cfg.Seed)), faults: map[string]int{}, crashes: map[string]int{},
		exitedAt: map[int]time.Time{}}
	if r.logs = cfg.Logs; r.logs == "" {
		if r.logs, err = os.MkdirTemp("", "once-chaos-"); err != nil {
			return nil, err
		}
		// The members' logs are kept when the run fails or breaks off.
		defer func() {
			if res != nil && res.Pass() {
				_ = os.RemoveAll(r.logs)
			} else {
				r.logf("members' logs kept in %s", r.logs)
			}
		}()
	} else if err := os.MkdirAll(r.logs, 0o755); err != nil {
		return nil, err
	}
	exe := cfg.Exe
	if exe == "" {
		r.logf("building the order-processor with -tags chaos")
		if exe, err = buildChaosExe(ctx, r.logs); err != nil {
			return nil, err
		}
	}
	defer r.killAll()

	r.pg, err = pgtemp.Start(ctx, pgtemp.Options{})
	if err != nil {
		return nil, err
	}
	defer r.pg.Close()
	r.o = &options{broker: r.memberBroker(), schema: "chaos", partitions: 4, unknownOrderWait: 100 * time.Millisecond, maxAttempts: 4,
		shipping: true}
	// More poison than the demo's, so that every batch of traffic has some.
	r.o.mix = Mix{Duplicates: 0.05, IDless: 0.03, Malformed: 0.02, Violations: 0.06}
	suffix := fmt.Sprintf("chaos-%d-%d", cfg.Seed, time.Now().UnixNano()%1000000)
	r.o.topic, r.o.name = "orders-"+suffix, "order-processor-"+suffix
	if r.pool, err = openPool(ctx, r.pg.URL(), r.o.schema); err != nil {
		return nil, err
	}
	defer r.pool.Close()
	if err := resetDemoTables(ctx, r.pool); err != nil {
		return nil, err
	}

	switch cfg.Broker {
	case "kafka":
		if err := r.startKafka(); err != nil {
			return nil, err
		}
	case "apache-kafka":
		if err := r.startApacheKafka(ctx); err != nil {
			return nil, err
		}
	case "amqp":
		if cfg.AMQPURL == "" {
			return nil, errors.New("the amqp chaos run needs AMQP_URL")
		}
		r.o.mix.Unordered = true
		r.o.unknownOrderWait, r.o.maxAttempts = 250*time.Millisecond, 8
		closeFn, err := r.startAMQP(ctx)
		if err != nil {
			return nil, err
		}
		defer closeFn()
	default:
		return nil, fmt.Errorf("broker %q: want kafka, apache-kafka or amqp", cfg.Broker)
	}
	if err := r.withHop2Backlog(); err != nil {
		return nil, err
	}
	r.plan = &Plan{Sent: map[string]int{}, Orders: map[string]expectedOrder{}}
	if r.pub, err = newPublisher(ctx, r.o); err != nil {
		return nil, err
	}
	defer func() {
		if r.pub != nil {
			_ = r.pub.Close()
		}
	}()

	faults := r.schedule()
	r.scheduled = faultKinds(faults)
	r.perFault = max(50, cfg.Orders/(len(faults)+1))
	r.logf("%d faults, %d members, about %d orders before each, logs in %s", len(faults), cfg.Members, r.perFault, r.logs)
	for i := 0; i < cfg.Members; i++ {
		if _, err := r.startMember(exe); err != nil {
			return nil, err
		}
	}
	for i, f := range faults {
		if err := r.traffic(ctx, r.perFault); err != nil {
			return nil, err
		}
		if err := r.waitProgress(ctx, 40); err != nil {
			return nil, fmt.Errorf("before fault %d (%s): %w", i+1, f.kind, err)
		}
		r.logf("fault %d/%d: %s %s", i+1, len(faults), f.kind, f.point)
		if err := r.apply(ctx, exe, f); err != nil {
			return nil, fmt.Errorf("fault %d (%s %s): %w", i+1, f.kind, f.point, err)
		}
	}
	if err := r.traffic(ctx, r.perFault); err != nil {
		return nil, err
	}
	r.logf("faults done; draining")
	if err := r.drain(ctx, exe); err != nil {
		return nil, err
	}

	// Events that overtook their order.created past the retry window
	// (RabbitMQ gives no order; a crash puts unacked messages back out of
	// place) were dead-lettered; replay those whose order exists now, as
	// the demo does.
	dlq, err := r.dlq()
	if err != nil {
		return nil, fmt.Errorf("read the dead-letter queue: %w", err)
	}
	replay, err := replayable(ctx, r.pool, dlq)
	if err != nil {
		return nil, err
	}
	crashLooped, err := r.crashLooped(ctx, dlq)
	if err != nil {
		return nil, err
	}
	replay = append(replay, crashLooped...)
	if len(replay) > 0 {
		r.logf("replaying %d dead letters (%d valid events dead-lettered as crash-loop)", len(replay), len(crashLooped))
		if err := r.publish(ctx, replay); err != nil {
			return nil, err
		}
		if err := r.drain(ctx, exe); err != nil {
			return nil, err
		}
		if dlq, err = r.dlq(); err != nil {
			return nil, err
		}
	}
	hop2DLQ, hop2Replayed, err := r.replayHop2(ctx, exe)
	if err != nil {
		return nil, err
	}
	res, err = r.count(ctx, dlq)
	if err != nil {
		return nil, err
	}
	res.Hop2.DLQByKind, res.Hop2.Replayed = hop2DLQ, hop2Replayed
	res.Replayed = len(replay)
	res.CrashLoopReplayed = len(crashLooped)
	res.Elapsed = time.Since(start).Round(time.Millisecond).String()
	return res, nil
}

// crashLooped returns the valid events of the plan that were dead-lettered
// with kind crash-loop and have no effect: they were in flight at
// CrashGuard.MaxCrashes process deaths (a payment waiting seconds for its order
// across kills, say). Like any dead letter whose cause is gone, they are
// replayed, once per event id, with their original key, value, id and type.
func (r *chaosRun) crashLooped(ctx context.Context, dlq []deadLetter) ([]outMsg, error) {
	valid := map[string]bool{}
	for _, m := range r.plan.Messages {
		if m.Kind == kindEvent || m.Kind == kindIDless {
			id := m.ID
			if id == "" {
				id, _ = EventID(&consumer.Message{Value: m.Value, Type: m.Type})
			}
			valid[id] = true
		}
	}
	var out []outMsg
	seen := map[string]bool{}
	for _, d := range dlq {
		id := d.Headers[consumer.HeaderEventID]
		if seen[id] || !valid[id] || !causeUnknown(d) {
			continue
		}
		seen[id] = true
		var done bool
		if err := r.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM processed_events WHERE consumer = $1 AND event_id = $2)`,
			r.o.name, id).Scan(&done); err != nil {
			return nil, err
		}
		if done {
			continue
		}
		m := outMsg{Key: string(d.Key), Value: d.Value, ID: d.ID, Type: d.Type}
		if m.ID == "" {
			m.ID = d.Headers["id"]
		}
		if m.Type == "" {
			m.Type = d.Headers["type"]
		}
		out = append(out, m)
	}
	return out, nil
}

// buildChaosExe builds this program with -tags chaos (its crash points
// compiled in) into dir.
func buildChaosExe(ctx context.Context, dir string) (string, error) {
	exe := filepath.Join(dir, "order-processor-chaos")
	b := exec.CommandContext(ctx, "go", "build", "-tags", "chaos", "-o", exe, "github.com/onceco/once/examples/order-processor")
	if out, err := b.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build -tags chaos: %w\n%s", err, out)
	}
	return exe, nil
}

// startKafka starts kfake in this process on a loopback port, behind a
// listener that can cut every connection; it outlives the members.
func (r *chaosRun) startKafka() error {
	var ln *netcut.Listener
	kf, err := kfake.NewCluster(kfake.NumBrokers(1),
		kfake.GroupMinSessionTimeout(500*time.Millisecond),
		kfake.SeedTopics(int32(r.o.partitions), topicsOf(r.o.topic)...),
		kfake.ListenFn(func(network, addr string) (net.Listener, error) {
			inner, err := net.Listen(network, addr)
			if err != nil {
				return nil, err
			}
			ln = &netcut.Listener{Listener: inner}
			return ln, nil
		}))
	if err != nil {
		return err
	}
	r.o.kafkaBrokers = kf.ListenAddrs()
	r.o.fastFailover = true
	r.cut = ln.Cut
	kd, err := newKafkaDrained(r.o.kafkaBrokers, r.o.name, r.o.topic)
	if err != nil {
		kf.Close()
		return err
	}
	r.lag = func(context.Context) (int64, error) { return kd.Lag(context.Background()) }
	r.dlq = func() ([]deadLetter, error) {
		return readKafkaTopic(r.o.kafkaBrokers, r.o.topic+kafka.DefaultDeadLetterSuffix)
	}
	r.closers = append(r.closers, func() { _ = kd.Close(); kf.Close() })
	r.reaper = r.startReaper(kf)
	return nil
}

// memberBroker is the -broker of the members: the protocol they speak.
func (r *chaosRun) memberBroker() string {
	if r.cfg.Broker == "apache-kafka" {
		return "kafka"
	}
	return r.cfg.Broker
}

// isKafka reports whether the run's broker speaks Kafka (kfake or Apache
// Kafka).
func (r *chaosRun) isKafka() bool { return r.memberBroker() == "kafka" }

// startApacheKafka starts three Apache Kafka nodes (replication factor 3,
// min.insync.replicas 2) and the run's topics; they outlive the members.
func (r *chaosRun) startApacheKafka(ctx context.Context) error {
	c, err := kafkatemp.Start(ctx, kafkatemp.Options{Nodes: 3, Properties: map[string]string{"min.insync.replicas": "2"}})
	if err != nil {
		return err
	}
	r.real = c
	r.closers = append(r.closers, func() { _ = c.Close() })
	r.o.kafkaBrokers = c.Brokers()
	r.o.fastFailover = true
	admin, err := sarama.NewClusterAdmin(r.o.kafkaBrokers, kafkatemp.ProbeConfig())
	if err != nil {
		return err
	}
	defer admin.Close()
	for _, t := range topicsOf(r.o.topic) {
		if err := admin.CreateTopic(t, &sarama.TopicDetail{NumPartitions: int32(r.o.partitions), ReplicationFactor: 3}, false); err != nil {
			return fmt.Errorf("create topic %s: %w", t, err)
		}
	}
	kd, err := newKafkaDrained(r.o.kafkaBrokers, r.o.name, r.o.topic)
	if err != nil {
		return err
	}
	r.lag = func(context.Context) (int64, error) { return kd.Lag(context.Background()) }
	r.dlq = func() ([]deadLetter, error) {
		return readKafkaTopic(r.o.kafkaBrokers, r.o.topic+kafka.DefaultDeadLetterSuffix)
	}
	r.closers = append(r.closers, func() { _ = kd.Close() })
	return nil
}

// killBroker kills with SIGKILL the node that coordinates the members'
// group (else the leader of the topic's partition 0) mid-stream, and
// restarts it once the cluster elected new leaders.
func (r *chaosRun) killBroker(ctx context.Context) error {
	client, err := sarama.NewClient(r.o.kafkaBrokers, kafkatemp.ProbeConfig())
	if err != nil {
		return err
	}
	victim := -1
	if b, err := client.Coordinator(r.o.name); err == nil {
		victim = r.real.IndexOf(b.ID())
	}
	role := "group coordinator"
	if victim < 0 {
		if b, err := client.Leader(r.o.topic, 0); err == nil {
			victim, role = r.real.IndexOf(b.ID()), "leader of partition 0"
		}
	}
	leaders := map[int32]int32{}
	for p := range int32(r.o.partitions) {
		if b, err := client.Leader(r.o.topic, p); err == nil {
			leaders[p] = b.ID()
		}
	}
	_ = client.Close()
	if victim < 0 {
		victim = r.rng.Intn(r.real.Nodes())
		role = "a random node"
	}
	r.logf("SIGKILL of broker %d (%s; partition leaders %v)", r.real.NodeID(victim), role, leaders)
	if err := r.real.Kill(victim); err != nil {
		return err
	}
	pause(ctx, time.Duration(1000+r.rng.Intn(2000))*time.Millisecond)
	if err := r.real.Restart(ctx, victim); err != nil {
		return fmt.Errorf("restart broker %d: %w", r.real.NodeID(victim), err)
	}
	return nil
}

// startAMQP declares the run's queues and starts a TCP proxy between the
// members and RabbitMQ whose connections the driver can cut.
func (r *chaosRun) startAMQP(ctx context.Context) (func(), error) {
	r.o.amqpURL = r.cfg.AMQPURL
	if err := prepareAMQP(ctx, r.o); err != nil {
		return nil, err
	}
	queues, err := newAMQPQueues(r.cfg.AMQPURL, r.o.topic)
	if err != nil {
		return nil, err
	}
	u, err := url.Parse(r.cfg.AMQPURL)
	if err != nil {
		return nil, err
	}
	upstream := u.Host
	if u.Port() == "" {
		upstream = net.JoinHostPort(u.Hostname(), "5672")
	}
	px, err := netcut.NewProxy(upstream)
	if err != nil {
		_ = queues.Close()
		return nil, err
	}
	// The members connect through the proxy; the driver's own publisher
	// and inspection connect directly.
	pu := *u
	pu.Host = px.Addr()
	r.memberAMQP = pu.String()
	r.cut = px.Cut
	r.lag = func(context.Context) (int64, error) { n, _, err := queues.Ready(); return int64(n), err }
	r.dlq = queues.DeadLetters
	return func() {
		_ = px.Close()
		_ = deleteShippingQueues(r.o)
		_ = queues.Delete()
		_ = queues.Close()
	}, nil
}

// faultKinds counts the faults of fs by kind.
func faultKinds(fs []fault) map[string]int {
	n := map[string]int{}
	for _, f := range fs {
		n[f.kind]++
	}
	return n
}

// fault is one fault of the schedule.
type fault struct {
	kind  string // kill, crash-point, pg-restart, cut, rebalance-kill, ...
	point string
	n     int
}

// schedule returns the faults in a seeded random order, the crash points
// spread over the first two thirds (they need traffic to reach).
func (r *chaosRun) schedule() []fault {
	var fs []fault
	for i := 0; i < r.cfg.Kills; i++ {
		fs = append(fs, fault{kind: "kill"})
	}
	for i := 0; i < r.cfg.PGRestarts; i++ {
		fs = append(fs, fault{kind: "pg-restart"})
	}
	for i := 0; i < r.cfg.Cuts; i++ {
		if r.cfg.Broker == "apache-kafka" {
			// Apache Kafka's nodes run in JVMs of their own: the broker
			// itself dies instead of its connections.
			fs = append(fs, fault{kind: "broker-kill"})
			continue
		}
		fs = append(fs, fault{kind: "cut"})
	}
	if r.isKafka() {
		for i := 0; i < r.cfg.Rebalances; i++ {
			fs = append(fs, fault{kind: "rebalance-kill"})
		}
	}
	fs = append(fs, r.hop2Faults()...)
	fs = append(fs, r.offsetsFaults()...)
	fs = append(fs, r.schemaFaults()...)
	r.rng.Shuffle(len(fs), func(i, j int) { fs[i], fs[j] = fs[j], fs[i] })
	if r.cfg.CrashPoints {
		span := max(1, len(fs)*2/3)
		// mid-batch first: it needs the largest backlog.
		points := append([]string{"mid-batch"}, append(crashPointNames[:4:4], relayCrashPoint)...)
		for i, p := range points {
			n := 1 + r.rng.Intn(3)
			if p == "after-dead-letter" || p == relayCrashPoint {
				n = 1
			}
			at := min(len(fs), i*span/len(points)+i)
			fs = append(fs[:at], append([]fault{{kind: "crash-point", point: p, n: n}}, fs[at:]...)...)
		}
	}
	return fs
}

// traffic generates a new batch of orders (the generator with a seed of
// its own, so ids never collide with earlier batches), adds it to the
// run's plan and publishes it.
func (r *chaosRun) traffic(ctx context.Context, orders int) error {
	r.batches++
	mix := r.o.mix
	mix.Orders = orders
	mix.Seed = r.cfg.Seed*1000 + int64(r.batches)
	p := Generate(mix)
	r.plan.Messages = append(r.plan.Messages, p.Messages...)
	for k, n := range p.Sent {
		r.plan.Sent[k] += n
	}
	for id, o := range p.Orders {
		r.plan.Orders[id] = o
	}
	r.plan.LedgerSum += p.LedgerSum
	r.plan.LedgerRows += p.LedgerRows
	r.plan.Malformed += p.Malformed
	r.plan.Violations += p.Violations
	return r.publish(ctx, p.Messages)
}

// publish sends msgs, retrying through broker cuts (the Kafka producer is
// idempotent; an AMQP message confirmed twice is a duplicate the consumer
// skips) with a new publisher each time; a publisher that cannot be opened
// is opened again on the next attempt.
func (r *chaosRun) publish(ctx context.Context, msgs []outMsg) error {
	var err error
	for attempt := 0; attempt < 10; attempt++ {
		if r.pub == nil {
			var pub publisher
			if pub, err = newPublisher(ctx, r.o); err != nil {
				r.logf("publish: %v; retrying", err)
				continue
			}
			r.pub = pub
		}
		if err = r.pub.Publish(ctx, msgs); err == nil {
			return nil
		}
		r.logf("publish: %v; retrying", err)
		_ = r.pub.Close()
		r.pub = nil
	}
	return fmt.Errorf("publish: %w", err)
}

// processed counts the processed events of both consumers (orders and
// shipping).
func (r *chaosRun) processed(ctx context.Context) (int64, error) {
	var n int64
	qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	err := r.pool.QueryRow(qctx, `SELECT count(*) FROM processed_events WHERE consumer = ANY($1)`, hop2Names(r.o)).Scan(&n)
	return n, err
}

// waitProgress waits until the members have processed step more events, or
// the broker has nothing left for them.
func (r *chaosRun) waitProgress(ctx context.Context, step int64) error {
	var base int64 = -1
	deadline := time.Now().Add(90 * time.Second)
	for time.Now().Before(deadline) {
		n, err := r.processed(ctx)
		if err == nil {
			if base < 0 {
				base = n
			}
			if n >= base+step {
				return nil
			}
			if lag, err := r.lag(ctx); err == nil && lag == 0 {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	return fmt.Errorf("no progress within 90s (processed %d)", base)
}

// startMember starts a consumer process; extraEnv is added to its
// environment (ONCE_CRASH_POINT).
func (r *chaosRun) startMember(exe string, extraEnv ...string) (*member, error) {
	id := r.newMemberID()
	args := []string{"serve", "-broker", r.memberBroker(), "-topic", r.o.topic, "-name", r.o.name, "-schema", r.o.schema,
		"-metrics-addr", "off", "-label", fmt.Sprintf("member %d:", id),
		"-unknown-order-wait", r.o.unknownOrderWait.String(), "-max-attempts", strconv.Itoa(r.o.maxAttempts)}
	if r.o.fastFailover {
		args = append(args, "-fast-failover")
	}
	args = append(args, r.offsetsArgs()...)
	cmd := exec.Command(exe, args...)
	env := append([]string{}, os.Environ()...)
	env = append(env, "DATABASE_URL="+r.pg.URL(), "BROKER="+r.memberBroker(), "KAFKA_BROKERS="+strings.Join(r.o.kafkaBrokers, ","),
		"PGAPPNAME="+memberAppName(id), "KAFKA_CLIENT_ID="+memberAppName(id))
	if r.cfg.Broker == "amqp" {
		env = append(env, "AMQP_URL="+r.memberAMQP)
	}
	cmd.Env = append(env, extraEnv...)
	// extraEnv arms a crash point (crashEnv): the member may exit with
	// crashExitCode.
	return r.launch(id, cmd, strings.Join(extraEnv, " "))
}

// newMemberID returns the id of the member about to start.
func (r *chaosRun) newMemberID() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.nextID++
	r.starts++
	return r.nextID
}

// launch starts cmd as member id, its output in the member's log file;
// crashPoint is the crash point armed in it (its crashEnv), if any.
func (r *chaosRun) launch(id int, cmd *exec.Cmd, crashPoint string) (*member, error) {
	out := filepath.Join(r.logs, fmt.Sprintf("member-%03d.log", id))
	f, err := os.Create(out)
	if err != nil {
		return nil, err
	}
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		f.Close()
		return nil, err
	}
	m := &member{id: id, cmd: cmd, out: out, exited: make(chan struct{}), crashPoint: crashPoint}
	go func() {
		_ = cmd.Wait()
		m.code = cmd.ProcessState.ExitCode()
		why := m.endedByItself()
		r.mu.Lock()
		r.exitedAt[id] = time.Now()
		if why != "" {
			r.selfEnded = append(r.selfEnded, fmt.Sprintf("member %d %s (see %s)", id, why, out))
		}
		r.mu.Unlock()
		f.Close()
		close(m.exited)
	}()
	r.mu.Lock()
	r.members = append(r.members, m)
	r.mu.Unlock()
	return m, nil
}

// live returns the members still running.
func (r *chaosRun) live() []*member {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []*member
	for _, m := range r.members {
		select {
		case <-m.exited:
		default:
			out = append(out, m)
		}
	}
	return out
}

// forget removes m from the members and adds its reported duplicates.
func (r *chaosRun) forget(m *member) {
	<-m.exited
	r.mu.Lock()
	defer r.mu.Unlock()
	for i, x := range r.members {
		if x == m {
			r.members = append(r.members[:i], r.members[i+1:]...)
			break
		}
	}
	r.dups += reportedDuplicates(m.out)
}

var dupRe = regexp.MustCompile(`duplicates skipped (\d+)`)

// reportedDuplicates returns the last duplicate count of the order
// consumer a member's log shows: its progress lines and its "stopped:"
// line, not the shipping consumer's "shipping stopped:" after it.
func reportedDuplicates(path string) uint64 {
	f, err := os.Open(path)
	if err != nil {
		return 0
	}
	defer f.Close()
	var last uint64
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if strings.HasPrefix(sc.Text(), "shipping stopped:") {
			continue
		}
		if m := dupRe.FindStringSubmatch(sc.Text()); m != nil {
			last, _ = strconv.ParseUint(m[1], 10, 64)
		}
	}
	return last
}

// kill sends m SIGKILL and waits until it exited. It reports whether the
// signal ended the process: false if it had exited on its own.
func (m *member) kill() bool {
	_ = m.cmd.Process.Signal(syscall.SIGKILL)
	<-m.exited
	ws, ok := m.cmd.ProcessState.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
}

// stop asks m to drain and stop (SIGTERM), and kills it after a minute.
func (m *member) stop() {
	m.stopping.Store(true)
	_ = m.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-m.exited:
	case <-time.After(time.Minute):
		m.hung.Store(true)
		m.kill()
	}
}

func (r *chaosRun) killAll() {
	for _, m := range r.live() {
		m.kill()
	}
	for i := len(r.closers) - 1; i >= 0; i-- {
		r.closers[i]()
	}
	r.closers = nil
}

// pause waits d, or less if ctx ends.
func pause(ctx context.Context, d time.Duration) {
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
}

// randomMember picks a running member.
func (r *chaosRun) randomMember() *member {
	l := r.live()
	if len(l) == 0 {
		return nil
	}
	return l[r.rng.Intn(len(l))]
}

// apply injects one fault and brings the members back to full strength.
// The fault counts as injected only if it hit something: a kill that found
// its member exited, or a cut with no connection, did not happen.
func (r *chaosRun) apply(ctx context.Context, exe string, f fault) error {
	hit := true
	switch f.kind {
	case "kill":
		// A random moment: up to 300 ms after the last progress check.
		pause(ctx, time.Duration(r.rng.Intn(300))*time.Millisecond)
		hit = false
		if m := r.randomMember(); m != nil {
			hit = m.kill()
			r.forget(m)
		}
		// Restart at once or after the group noticed (partitions move).
		pause(ctx, time.Duration(r.rng.Intn(1500))*time.Millisecond)
	case "rebalance-kill":
		victim := r.randomMember()
		if _, err := r.startMember(exe); err != nil {
			return err
		}
		// Kill the victim while the new member joins the group.
		pause(ctx, time.Duration(100+r.rng.Intn(400))*time.Millisecond)
		hit = false
		if victim != nil {
			hit = victim.kill()
			r.forget(victim)
		}
	case "pg-restart":
		pause(ctx, time.Duration(r.rng.Intn(200))*time.Millisecond)
		if err := r.pg.Stop(ctx); err != nil {
			return fmt.Errorf("stop PostgreSQL: %w", err)
		}
		pause(ctx, time.Duration(500+r.rng.Intn(1500))*time.Millisecond)
		if err := r.pg.Restart(ctx); err != nil {
			return fmt.Errorf("restart PostgreSQL: %w", err)
		}
	case "cut":
		pause(ctx, time.Duration(r.rng.Intn(300))*time.Millisecond)
		n := r.cut()
		r.logf("cut %d connections", n)
		hit = n > 0
	case "broker-kill":
		pause(ctx, time.Duration(r.rng.Intn(300))*time.Millisecond)
		if err := r.killBroker(ctx); err != nil {
			return err
		}
	case "crash-point":
		var err error
		if hit, err = r.crashAt(ctx, exe, f); err != nil {
			return err
		}
	case "relay-leader-kill":
		if err := r.killRelayLeader(ctx); err != nil {
			return err
		}
	case faultDeleteGroup:
		if err := r.deleteGroup(ctx); err != nil {
			return err
		}
	case faultSchemaChange:
		if err := r.changeColumnType(ctx); err != nil {
			return err
		}
	}
	if hit {
		r.faults[f.kind]++
	} else {
		r.logf("fault %s %s hit nothing: not counted", f.kind, f.point)
	}
	for len(r.live()) < r.cfg.Members {
		if _, err := r.startMember(exe); err != nil {
			return err
		}
	}
	return nil
}

// crashAt restarts one member with ONCE_CRASH_POINT set and waits until the
// crash point kills it (exit status 86), publishing traffic meanwhile. It
// reports whether the member crashed there: false if the point was not
// reached within 90s.
func (r *chaosRun) crashAt(ctx context.Context, exe string, f fault) (bool, error) {
	if m := r.randomMember(); m != nil {
		m.kill()
		r.forget(m)
	}
	if f.point == "after-dead-letter" {
		// Poison for every partition, so that the crashing member has
		// some whatever it is assigned.
		var poison []outMsg
		for i := 0; i < 4*r.o.partitions; i++ {
			r.extra++
			id := fmt.Sprintf("o-%d-poison-%04d", r.cfg.Seed, r.extra)
			poison = append(poison, outMsg{Key: id, Value: []byte(`{"order_id":"` + id + `",`),
				ID: fmt.Sprintf("evt-%d-poison-%04d", r.cfg.Seed, r.extra), Type: TypeCreated, Kind: kindMalformed})
		}
		r.plan.Messages = append(r.plan.Messages, poison...)
		r.plan.Sent[kindMalformed] += len(poison)
		r.plan.Malformed += len(poison)
		if err := r.publish(ctx, poison); err != nil {
			return false, err
		}
	}
	if f.point == "mid-batch" && r.isKafka() {
		// Batches form only after the first Batch.Size (100) messages of a
		// fresh assignment, handled one at a time: stop every member and
		// let a backlog of more than that per partition build up.
		for _, m := range r.live() {
			m.kill()
			r.forget(m)
		}
		if err := r.traffic(ctx, 75*r.o.partitions); err != nil {
			return false, err
		}
	}
	r.stopOthersForRelayCrash(f)
	m, err := r.startMember(exe, crashEnv(f))
	if err != nil {
		return false, err
	}
	deadline := time.After(90 * time.Second)
	for {
		select {
		case <-m.exited:
			r.forget(m)
			if m.code != crashExitCode {
				return false, fmt.Errorf("member %d with crash point %s exited with %d, want %d (see %s)", m.id, f.point, m.code, crashExitCode, m.out)
			}
			if out, err := os.ReadFile(m.out); err != nil || !strings.Contains(string(out), "once: chaos crash at "+f.point+" #") {
				return false, fmt.Errorf("member %d exited with %d but its log does not say it crashed at %s (see %s)", m.id, m.code, f.point, m.out)
			}
			r.crashes[f.point]++
			return true, nil
		case <-deadline:
			r.logf("crash point %s:%d not reached within 90s", f.point, f.n)
			m.kill()
			r.forget(m)
			return false, nil
		case <-ctx.Done():
			return false, ctx.Err()
		case <-time.After(2 * time.Second):
			// Still running: it needs more traffic to reach the point.
			if err := r.traffic(ctx, 50); err != nil {
				return false, err
			}
		}
	}
}

// drain lets the members finish the backlog, stops them gracefully, and
// repeats with one member until the broker holds nothing unsettled.
func (r *chaosRun) drain(ctx context.Context, exe string) error {
	deadline := time.Now().Add(5 * time.Minute)
	for round := 0; time.Now().Before(deadline); round++ {
		if len(r.live()) == 0 {
			if _, err := r.startMember(exe); err != nil {
				return err
			}
		}
		// Quiet: nothing left at the broker and no new processed events
		// for 3 s (AMQP counts the messages in flight as not ready).
		var last int64 = -1
		quietSince, lastSaid := time.Now(), time.Now()
		for time.Now().Before(deadline) {
			n, err := r.processed(ctx)
			lag, lerr := r.lag(ctx)
			if time.Since(lastSaid) > 10*time.Second {
				// Say why the drain goes on, for a run that does not end.
				r.logf("draining: %d processed, lag %d (%v, %v)", n, lag, err, lerr)
				lastSaid = time.Now()
			}
			if err == nil && lerr == nil {
				if n != last || lag != 0 {
					last, quietSince = n, time.Now()
				} else if time.Since(quietSince) > 3*time.Second {
					break
				}
			}
			pause(ctx, 100*time.Millisecond)
			if ctx.Err() != nil {
				return ctx.Err()
			}
		}
		for _, m := range r.live() {
			m.stop()
			r.forget(m)
		}
		if r.isKafka() {
			// Offsets are committed on Close; the lag is now exact.
			if lag, err := r.lag(ctx); err == nil && lag == 0 {
				return nil
			}
		} else if lag, err := r.lag(ctx); err == nil && lag == 0 {
			return nil
		}
		r.logf("drain round %d: the broker still holds messages; one more member", round+1)
	}
	return errors.New("the members did not drain the broker within 5 minutes")
}

// count compares the database and the dead-letter queue with the plan.
func (r *chaosRun) count(ctx context.Context, dlq []deadLetter) (*ChaosResult, error) {
	res := &ChaosResult{Broker: r.cfg.Broker, Seed: r.cfg.Seed, SentByKind: map[string]int{}, DLQByKind: map[string]int{},
		DLQIDsByKind: map[string]int{}, Faults: r.faults, CrashPoints: r.crashes, Members: r.cfg.Members, Starts: r.starts,
		DuplicatesSkipped: r.dups}
	if r.reaper != nil {
		res.DeadMembersRemoved = r.reaper.Evicted()
	}
	res.Sent = len(r.plan.Messages)
	for k, n := range r.plan.Sent {
		res.SentByKind[k] = n
	}
	// Effects per event id: the order row a created event inserted, the
	// payment row a paid event inserted, the status a cancellation set.
	effects := map[string]int{}
	rows, err := r.pool.Query(ctx, `SELECT created_event, count(*) FROM orders GROUP BY created_event
		UNION ALL SELECT event_id, count(*) FROM payments GROUP BY event_id`)
	if err != nil {
		return nil, err
	}
	for rows.Next() {
		var id string
		var n int
		if err := rows.Scan(&id, &n); err != nil {
			rows.Close()
			return nil, err
		}
		effects[id] += n
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, err
	}
	cancelled := map[string]bool{}
	rows, err = r.pool.Query(ctx, `SELECT id FROM orders WHERE status = 'cancelled'`)
	if err != nil {
		return nil, err
	}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			rows.Close()
			return nil, err
		}
		cancelled[id] = true
	}
	rows.Close()
	var perOrderPayments []string
	if err := r.pool.QueryRow(ctx, `SELECT coalesce(array_agg(order_id), '{}') FROM (SELECT order_id FROM payments GROUP BY order_id HAVING count(*) > 1) d`).Scan(&perOrderPayments); err != nil {
		return nil, err
	}
	// The claims: which event ids the consumer recorded handled.
	claimed := map[string]bool{}
	rows, err = r.pool.Query(ctx, `SELECT event_id FROM processed_events WHERE consumer = $1`, r.o.name)
	if err != nil {
		return nil, err
	}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			rows.Close()
			return nil, err
		}
		claimed[id] = true
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, err
	}
	res.Processed = int64(len(claimed))

	dlKind := map[string]string{}
	for _, d := range dlq {
		k := d.Headers[consumer.HeaderErrorKind]
		res.DLQByKind[k]++
		id := d.Headers[consumer.HeaderEventID]
		if _, ok := dlKind[id]; !ok {
			res.DLQIDsByKind[k]++
		}
		dlKind[id] = k
	}
	res.DLQRecords = len(dlq)

	// A payment and a second payment of the same order ("paid twice") are
	// rivals: without order (RabbitMQ, and its redeliveries after a crash)
	// either may be handled first; the business rule keeps the first and
	// dead-letters the other. The pair must end with exactly one effect,
	// and the one without must be in the dead-letter queue.
	orderOf := func(m outMsg) string {
		var key struct {
			OrderID string `json:"order_id"`
		}
		_ = json.Unmarshal(m.Value, &key)
		return key.OrderID
	}
	eventID := func(m outMsg) string {
		if m.ID != "" {
			return m.ID
		}
		return orderOf(m) + "/" + m.Type
	}
	// An order may draw more than one second payment: each is a rival of
	// the order's payment.
	secondPayments := map[string][]string{} // order id -> event ids
	for _, m := range r.plan.Messages {
		if m.Kind == kindSecondPayment {
			secondPayments[orderOf(m)] = append(secondPayments[orderOf(m)], m.ID)
		}
	}
	rivals := map[string][]string{} // the payment -> its second payments
	rivalOf := map[string]string{}  // a second payment -> the payment
	for _, m := range r.plan.Messages {
		if ss := secondPayments[orderOf(m)]; len(ss) > 0 && m.Type == TypePaid && (m.Kind == kindEvent || m.Kind == kindIDless) {
			rivals[eventID(m)] = ss
			for _, s := range ss {
				rivalOf[s] = eventID(m)
			}
		}
	}
	rivalEffects := func(id string) int {
		n := 0
		for _, s := range rivals[id] {
			n += effects[s]
		}
		return n
	}
	handlerKind := string(consumer.KindHandler)

	// wantClaim is the event ids that must have a processed_events row:
	// every valid event, but one that lost its race to a rival, and the
	// rival that won it.
	wantClaim := map[string]bool{}
	seen := map[string]bool{}
	for _, m := range r.plan.Messages {
		switch m.Kind {
		case kindEvent, kindIDless:
			id := eventID(m)
			if seen[id] {
				continue
			}
			seen[id] = true
			res.UniqueEvents++
			n := effects[id]
			if effects[id] > 0 || rivalEffects(id) == 0 || dlKind[id] != handlerKind {
				wantClaim[id] = true
			}
			if m.Type == TypeCancelled && cancelled[orderOf(m)] {
				n = 1
			}
			if len(rivals[id]) > 0 {
				n += rivalEffects(id)
				if effects[id] == 0 && dlKind[id] != handlerKind {
					n = 0 // lost its race and is not in the dead-letter queue either
				}
			}
			switch n {
			case 1:
				res.EffectsOnce++
			case 0:
				res.Lost++
				if len(res.LostIDs) < 20 {
					res.LostIDs = append(res.LostIDs, fmt.Sprintf("%s (dead-lettered: %q)", id, dlKind[id]))
				}
			default:
				res.Doubled++
				if len(res.DoubledIDs) < 20 {
					res.DoubledIDs = append(res.DoubledIDs, fmt.Sprintf("%s (%d effects)", id, n))
				}
			}
		case kindDuplicate, kindIDlessDup: // copies: no effect of their own
		default: // poison: malformed or a rule violation
			res.Poison++
			want := handlerKind
			if m.Kind == kindMalformed {
				want = string(consumer.KindDecode)
			}
			rv, raced := rivalOf[m.ID]
			wonRace := raced && effects[m.ID] == 1 && effects[rv] == 0 && dlKind[rv] == handlerKind
			if dlKind[m.ID] == string(consumer.KindCrashLoop) {
				res.PoisonCrashLoop++
			}
			if dlKind[m.ID] == want || dlKind[m.ID] == string(consumer.KindCrashLoop) || wonRace {
				res.PoisonDeadLettered++
			} else if len(res.PoisonMissing) < 20 {
				res.PoisonMissing = append(res.PoisonMissing, fmt.Sprintf("%s (%s): dead-letter kind %q, want %q", m.ID, m.Kind, dlKind[m.ID], want))
			}
			if effects[m.ID] > 0 && !wonRace {
				res.Doubled++
				res.DoubledIDs = append(res.DoubledIDs, m.ID+" (poison with an effect)")
			}
			if wonRace {
				wantClaim[m.ID] = true
			}
		}
	}
	// Matched by id, not counted: a claim recorded under another id
	// leaves its event unprotected against a redelivery even when the
	// numbers agree.
	unclaimed, stray := claimDiff(wantClaim, claimed)
	res.Unclaimed, res.StrayClaims = len(unclaimed), len(stray)
	res.UnclaimedIDs, res.StrayClaimIDs = first(unclaimed, 20), first(stray, 20)
	if res.Unclaimed > 0 || res.StrayClaims > 0 {
		res.Problems = append(res.Problems, fmt.Sprintf("processed_events: %d valid events without their row, e.g. [%s]; %d rows of no event handled, e.g. [%s]",
			res.Unclaimed, strings.Join(first(unclaimed, 5), ", "), res.StrayClaims, strings.Join(first(stray, 5), ", ")))
	}
	for _, id := range perOrderPayments {
		res.Problems = append(res.Problems, "order "+id+" paid more than once")
	}

	// The order-processor's own verdict on the orders table and the ledger.
	var buf strings.Builder
	// Poison dead-lettered as crash-loop is in the dead-letter queue, as it
	// must be; the report expects the generator's kinds, so relabel it.
	poisonKind := map[string]string{}
	for _, m := range r.plan.Messages {
		switch m.Kind {
		case kindMalformed:
			poisonKind[m.ID] = string(consumer.KindDecode)
		case kindOrphanPayment, kindCancelPaid, kindSecondPayment, kindWrongAmount:
			poisonKind[m.ID] = handlerKind
		}
	}
	forReport := make([]deadLetter, len(dlq))
	for i, d := range dlq {
		forReport[i] = d
		id := d.Headers[consumer.HeaderEventID]
		if k := poisonKind[id]; k != "" && d.Headers[consumer.HeaderErrorKind] == string(consumer.KindCrashLoop) {
			h := map[string]string{}
			for k, v := range d.Headers {
				h[k] = v
			}
			h[consumer.HeaderErrorKind] = k
			forReport[i].Headers = h
		}
	}
	if err := report(ctx, &buf, r.pool, r.o, r.plan, runs{}, forReport, 0); err != nil {
		res.OrdersCheck = "FAIL"
		res.Problems = append(res.Problems, "the order-processor's report: "+lastMismatches(buf.String()))
	} else {
		res.OrdersCheck = "PASS (every order's status, amount and payments as sent)"
	}
	if res.Lost > 0 {
		res.Problems = append(res.Problems, fmt.Sprintf("%d events lost, e.g. %s", res.Lost, strings.Join(res.LostIDs, ", ")))
	}
	if res.Doubled > 0 {
		res.Problems = append(res.Problems, fmt.Sprintf("%d events doubled, e.g. %s", res.Doubled, strings.Join(res.DoubledIDs, ", ")))
	}
	if res.PoisonDeadLettered != res.Poison {
		res.Problems = append(res.Problems, fmt.Sprintf("%d poison messages not dead-lettered as expected, e.g. %s",
			res.Poison-res.PoisonDeadLettered, strings.Join(res.PoisonMissing, ", ")))
	}
	if res.Hop2, err = r.countHop2(ctx); err != nil {
		return nil, err
	}
	res.Problems = append(res.Problems, res.Hop2.problems(r.plan.LedgerRows)...)
	r.mu.Lock()
	res.MembersEndedByThemselves = append([]string(nil), r.selfEnded...)
	r.mu.Unlock()
	if n := len(res.MembersEndedByThemselves); n > 0 {
		res.Problems = append(res.Problems, fmt.Sprintf("%d members ended when the driver did not end them: %s",
			n, strings.Join(first(res.MembersEndedByThemselves, 5), "; ")))
	}
	offsets, err := r.offsetsProblems(ctx)
	if err != nil {
		return nil, err
	}
	res.Problems = append(res.Problems, offsets...)
	res.FaultsScheduled = r.scheduled
	for _, k := range sortedKeys(r.scheduled) {
		if got, want := r.faults[k], r.scheduled[k]; got < want {
			res.Problems = append(res.Problems, fmt.Sprintf("fault %s injected %d times of %d scheduled: the others hit nothing", k, got, want))
		}
	}
	if r.cfg.CrashPoints {
		for _, p := range append(crashPointNames[:len(crashPointNames):len(crashPointNames)], relayCrashPoint) {
			if r.crashes[p] == 0 {
				res.Problems = append(res.Problems, "crash point "+p+" was never reached")
			}
		}
	}
	if res.Pass() {
		res.Verdict = "PASS: lost = 0, doubled = 0, every poison message dead-lettered; hop 2: each paid order published and shipped once"
	} else {
		res.Verdict = "FAIL"
	}
	return res, nil
}

// claimDiff returns, sorted, the ids of want without a claim and the
// claims of ids not in want.
func claimDiff(want, claimed map[string]bool) (missing, stray []string) {
	for id := range want {
		if !claimed[id] {
			missing = append(missing, id)
		}
	}
	for id := range claimed {
		if !want[id] {
			stray = append(stray, id)
		}
	}
	sort.Strings(missing)
	sort.Strings(stray)
	return missing, stray
}

// sortedKeys returns m's keys in order.
func sortedKeys(m map[string]int) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// first returns the first n of ids, or all of them.
func first(ids []string, n int) []string { return ids[:min(n, len(ids))] }

// lastMismatches returns the report's lines that describe what differs.
func lastMismatches(report string) string {
	var out []string
	for _, l := range strings.Split(report, "\n") {
		if strings.Contains(l, "want") || strings.Contains(l, "mismatch") {
			out = append(out, strings.TrimSpace(l))
		}
	}
	sort.Strings(out)
	return strings.Join(out, "; ")
}
