package dlq

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/IBM/sarama"

	"github.com/onceco/once/cmd/once/internal/cut"
	"github.com/onceco/once/cmd/once/internal/kafkawait"
	"github.com/onceco/once/consumer"
	"github.com/onceco/once/internal/kafkaaddr"
	"github.com/onceco/once/internal/kafkaend"
	"github.com/onceco/once/internal/kafkarefusal"
)

// KafkaConfig configures a Kafka dead-letter topic.
type KafkaConfig struct {
	// Brokers are the bootstrap addresses ("host:port"). Required;
	// NewKafka refuses an address without a port.
	Brokers []string
	// Topic is the dead-letter topic ("orders.dlq"). Required.
	Topic string
	// Sarama is the base client configuration (TLS, SASL, Version). Nil
	// means sarama.NewConfig() with Version 2.8, and the bounds the once
	// command sets by default (-kafka-timeout): the dial and each request
	// wait 8s at most, and metadata is asked twice at most, so that a
	// broker that accepts connections and never answers fails a read or a
	// replay within about half a minute, with an error that says so
	// (sarama's own defaults, 30s a request and four metadata tries,
	// wait minutes). It is copied, never modified; the redrive producer
	// is made idempotent (and not transactional) with acks from all
	// in-sync replicas, and neither its Consumer.Interceptors nor its
	// Producer.Interceptors run: records are read and redriven as they
	// are written.
	Sarama *sarama.Config
	// IdleTimeout bounds the wait for the next record of a partition that
	// has not reached its last stable offset, and that the cluster says
	// still holds a record to read (transaction markers and aborted
	// records take offsets but are never delivered, and are not waited
	// for). A fetch that stalls longer (a leader election) fails the
	// read, saying where it stopped, rather than passing a part of the
	// topic for the whole; raise it on a cluster whose elections take
	// longer. Default 5s.
	IdleTimeout time.Duration
}

// KafkaQueue is a Kafka dead-letter topic. Build it with NewKafka.
type KafkaQueue struct {
	cfg KafkaConfig
}

// NewKafka validates cfg and returns the topic's Queue. It connects to
// nothing until used.
func NewKafka(cfg KafkaConfig) (*KafkaQueue, error) {
	if len(cfg.Brokers) == 0 {
		return nil, errors.New("dlq: KafkaConfig.Brokers is empty")
	}
	if err := kafkaaddr.Check("dlq", "KafkaConfig.Brokers", cfg.Brokers); err != nil {
		return nil, err
	}
	if cfg.Topic == "" {
		return nil, errors.New("dlq: KafkaConfig.Topic is empty")
	}
	if cfg.IdleTimeout < 0 {
		return nil, fmt.Errorf("dlq: KafkaConfig.IdleTimeout %v is negative", cfg.IdleTimeout)
	}
	if cfg.IdleTimeout == 0 {
		cfg.IdleTimeout = 5 * time.Second
	}
	return &KafkaQueue{cfg: cfg}, nil
}

// Name returns "kafka topic <Topic>".
func (q *KafkaQueue) Name() string { return "kafka topic " + q.cfg.Topic }

// Close releases nothing: every call has its own client.
func (q *KafkaQueue) Close() error { return nil }

// saramaConfig returns the client configuration of one operation, and
// the cutter that dials its connections: sarama's calls do not watch a
// context, and the operation's connections are cut when its context ends.
func (q *KafkaQueue) saramaConfig() (*sarama.Config, *cut.Cutter) {
	var sc sarama.Config
	if q.cfg.Sarama != nil {
		sc = *q.cfg.Sarama
	} else {
		sc = *kafkawait.NewConfig()
	}
	sc.Consumer.Return.Errors = true
	// As the Kafka Source reads by default: a record of a transaction
	// aborted upstream was never published.
	sc.Consumer.IsolationLevel = sarama.ReadCommitted
	sc.Metadata.AllowAutoTopicCreation = false
	// No interceptor: those of the base instrument (or transform) the
	// service's own clients. A consumer's would change the dead letters as
	// read, so that list and show print, and a replay redrives, records
	// the topic does not hold; a producer's would rewrite a redrive's
	// headers (OpenTelemetry's, its traceparent: the failure's span, which
	// the redrive's trace continues) after its size was reckoned.
	sc.Consumer.Interceptors, sc.Producer.Interceptors = nil, nil
	return &sc, cut.Sarama(&sc)
}

// explain says of err, when a request timed out on the bound of a
// configuration the caller did not give, what bounded it.
func (q *KafkaQueue) explain(err error) error {
	if q.cfg.Sarama != nil {
		return err
	}
	return kafkawait.Explain(err, kafkawait.Default, "dlq.KafkaConfig.Sarama is nil")
}

// Browse reads every partition of the topic from its oldest retained
// record to its last stable offset at the start, with a partition
// consumer (no group, nothing committed) reading committed records, as
// the Kafka Source does by default: the records of aborted transactions
// are skipped, and those of a transaction still open are not read. When ctx ends, the client's connections
// are closed: a call waiting on a broker that does not answer returns at
// once.
func (q *KafkaQueue) Browse(ctx context.Context, fn func(*Record) error) error {
	sc, cutter := q.saramaConfig()
	stop := cutter.On(ctx)
	defer stop()
	return q.explain(orCtx(ctx, q.browse(ctx, sc, fn)))
}

func (q *KafkaQueue) browse(ctx context.Context, sc *sarama.Config, fn func(*Record) error) error {
	client, err := sarama.NewClient(q.cfg.Brokers, sc)
	if err != nil {
		return fmt.Errorf("dlq: connect to kafka: %w", kafkarefusal.Explain(ctx, q.cfg.Brokers, sc, err))
	}
	defer client.Close()
	parts, err := client.Partitions(q.cfg.Topic)
	if err != nil {
		return fmt.Errorf("dlq: topic %s: %w", q.cfg.Topic, err)
	}
	cons, err := sarama.NewConsumerFromClient(client)
	if err != nil {
		return fmt.Errorf("dlq: %w", err)
	}
	defer cons.Close()
	pos := 0
	for _, p := range parts {
		if err := q.browsePartition(ctx, client, cons, p, &pos, fn); err != nil {
			return err
		}
	}
	return nil
}

func (q *KafkaQueue) browsePartition(ctx context.Context, client sarama.Client, cons sarama.Consumer, p int32, pos *int, fn func(*Record) error) error {
	oldest, err := client.GetOffset(q.cfg.Topic, p, sarama.OffsetOldest)
	if err != nil {
		return fmt.Errorf("dlq: %s/%d oldest offset: %w", q.cfg.Topic, p, err)
	}
	end, err := kafkaend.LastStableOffset(client, q.cfg.Topic, p)
	if err != nil {
		if err := client.RefreshMetadata(q.cfg.Topic); err != nil {
			return fmt.Errorf("dlq: %s/%d last stable offset: %w", q.cfg.Topic, p, err)
		}
		if end, err = kafkaend.LastStableOffset(client, q.cfg.Topic, p); err != nil {
			return fmt.Errorf("dlq: %s/%d last stable offset: %w", q.cfg.Topic, p, err)
		}
	}
	if end <= oldest || kafkaend.FirstReadable(client, q.cfg.Topic, p, oldest, end) >= end {
		return nil // no record, or markers and aborted records only
	}
	pc, err := cons.ConsumePartition(q.cfg.Topic, p, oldest)
	if err != nil {
		return fmt.Errorf("dlq: read %s/%d: %w", q.cfg.Topic, p, err)
	}
	defer pc.AsyncClose()
	idle := time.NewTimer(q.cfg.IdleTimeout)
	defer idle.Stop()
	// A pause in the records asks whether any readable record is left
	// below end: after the last, only markers and aborted records may
	// be, which are never delivered.
	quiet := time.NewTimer(quietWait)
	defer quiet.Stop()
	next := oldest
	for {
		select {
		case m, ok := <-pc.Messages():
			if !ok {
				// sarama gave the partition up (offset out of
				// range: retention removed records meanwhile); its
				// error comes before the channels close.
				if cerr, ok := <-pc.Errors(); ok {
					return fmt.Errorf("dlq: read %s/%d: %w", q.cfg.Topic, p, cerr)
				}
				return fmt.Errorf("dlq: read %s/%d: the partition consumer stopped", q.cfg.Topic, p)
			}
			*pos++
			if err := fn(kafkaRecord(q.cfg.Topic, *pos, m)); err != nil {
				return err
			}
			next = m.Offset + 1
			if next >= end {
				return nil
			}
			idle.Reset(q.cfg.IdleTimeout)
			quiet.Reset(quietWait)
		case <-quiet.C:
			if kafkaend.FirstReadable(client, q.cfg.Topic, p, next, end) >= end {
				return nil
			}
			quiet.Reset(quietWait)
		case cerr, ok := <-pc.Errors():
			if !ok {
				return fmt.Errorf("dlq: read %s/%d: the partition consumer stopped", q.cfg.Topic, p)
			}
			return fmt.Errorf("dlq: read %s/%d: %w", q.cfg.Topic, p, cerr)
		case <-idle.C:
			// No record for IdleTimeout, though one seemed left: past
			// a run of markers and aborted records the read is whole;
			// otherwise a fetch stalls (a leader election), and a read
			// that ended here would pass for whole.
			at := next
			for {
				n := kafkaend.FirstReadable(client, q.cfg.Topic, p, at, end)
				if n >= end {
					return nil
				}
				if n == at {
					break
				}
				at = n
			}
			return fmt.Errorf("dlq: read %s/%d: no record for %v at offset %d, below the last stable offset %d (a leader election, a broker that stalls): the read is not whole",
				q.cfg.Topic, p, q.cfg.IdleTimeout, at, end)
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// quietWait is how long a partition's read waits for a record before it
// asks whether any readable one is left.
const quietWait = 200 * time.Millisecond

func kafkaRecord(topic string, pos int, m *sarama.ConsumerMessage) *Record {
	r := &Record{
		Ref:       kafkaRef(m.Partition, m.Offset),
		Queue:     topic,
		Position:  pos,
		Partition: m.Partition,
		Offset:    m.Offset,
		Key:       m.Key,
		Value:     m.Value,
		Timestamp: m.Timestamp,
		Headers:   make([]Header, 0, len(m.Headers)),
	}
	raw := make([]sarama.RecordHeader, 0, len(m.Headers))
	for _, h := range m.Headers {
		if h == nil {
			continue
		}
		r.Headers = append(r.Headers, Header{string(h.Key), string(h.Value)})
		raw = append(raw, *h)
	}
	r.raw = raw
	return r
}

// Replay publishes the selected records to their original topics, each on
// the partition it was first read from when the topic still has it (so a
// record stays beside the other records of its key, whatever partitioner
// their producer used), else on the partition its key hashes to. Kafka
// dead letters are never removed. When ctx ends, the producer's
// connections are closed: a publish waiting on a broker that does not
// answer fails at once, and is not counted as replayed. It reads the
// topic twice, the selection's summaries first, then each selected record
// as it publishes it, so it holds one record's payload at a time (and
// what sarama reads ahead, Config.ChannelBufferSize records), not the
// selection's; a selected record that retention removed in between is
// skipped.
func (q *KafkaQueue) Replay(ctx context.Context, f Filter, opts ReplayOptions) (Report, error) {
	if err := opts.validate(); err != nil {
		return Report{}, err
	}
	// The selection is read twice, so that no more than one record and
	// its payload is held at a time: first the summaries of those f
	// selects (and the size of the largest redrive), then each again as
	// it is published. A replay of a large topic held every record it
	// selected, and the batches they were read in, until it ended.
	var recs []*Record
	size := 0
	err := q.Browse(ctx, func(r *Record) error {
		if f.Match(r) {
			recs = append(recs, r.Summary())
			size = max(size, redriveBytes(r, opts))
		}
		return nil
	})
	if err != nil {
		return Report{}, err
	}
	if opts.DryRun || len(recs) == 0 {
		return replayLoop(ctx, recs, opts, nil)
	}
	sc, cutter := q.saramaConfig()
	stop := cutter.On(ctx)
	defer stop()
	sc.Producer.Idempotent = true
	sc.Producer.RequiredAcks = sarama.WaitForAll
	sc.Producer.Return.Successes = true
	sc.Producer.Return.Errors = true
	sc.Producer.Partitioner = newOriginalPartitioner
	sc.Net.MaxOpenRequests = 1
	// Idempotent, not transactional: a transactional producer refuses
	// every send made outside a transaction.
	sc.Producer.Transaction.ID = ""
	// No flush trigger: the copies are sent one at a time, each waited
	// for, and a trigger set for batching (Flush.Messages, Flush.Bytes)
	// would hold each until Flush.Frequency, or for ever without one.
	sc.Producer.Flush.Messages, sc.Producer.Flush.Bytes, sc.Producer.Flush.Frequency = 0, 0, 0
	if sc.Producer.Retry.Max < 1 {
		sc.Producer.Retry.Max = 1
	}
	// A dead letter may be larger than the producer's limit (1 MiB by
	// default): its consumer's dead-letter producer had it raised, and the
	// cluster took the record. The cluster judges the redrive's size.
	sc.Producer.MaxMessageBytes = max(sc.Producer.MaxMessageBytes, size)
	client, err := sarama.NewClient(q.cfg.Brokers, sc)
	if err != nil {
		return Report{}, q.explain(orCtx(ctx, fmt.Errorf("dlq: connect to kafka: %w", kafkarefusal.Explain(ctx, q.cfg.Brokers, sc, err))))
	}
	defer client.Close()
	prod, err := sarama.NewSyncProducerFromClient(client)
	if err != nil {
		return Report{}, orCtx(ctx, fmt.Errorf("dlq: redrive producer: %w", err))
	}
	defer prod.Close()
	rp := newReplayer(len(recs), opts, func(r *Record, redrive []Header) (string, error) {
		out := kafkaRedrive(r, redrive)
		n, err := client.Partitions(out.Topic)
		if err != nil {
			return "", orCtx(ctx, fmt.Errorf("topic %s: %w", out.Topic, err))
		}
		if out.Partition >= int32(len(n)) {
			out.Partition = -1
		}
		part, _, err := prod.SendMessage(out)
		if err != nil {
			return "", orCtx(ctx, err)
		}
		return out.Topic + "/" + strconv.FormatInt(int64(part), 10), nil
	})
	defer rp.stop()
	return q.republish(ctx, recs, rp)
}

// republish reads the topic again and steps rp through the records of
// recs, the selection's summaries, as they come. A record of recs that
// is no longer there (retention removed it since the selection was read)
// is skipped; one written since is not in recs.
func (q *KafkaQueue) republish(ctx context.Context, recs []*Record, rp *replayer) (Report, error) {
	selected := make(map[string]*Record, len(recs))
	for _, r := range recs {
		selected[r.Ref] = r
	}
	var failed error
	err := q.Browse(ctx, func(r *Record) error {
		s := selected[r.Ref]
		if s == nil {
			return nil
		}
		delete(selected, r.Ref)
		r.Position = s.Position // as the selection's read numbered it
		failed = rp.step(ctx, r)
		return failed
	})
	if failed != nil {
		return rp.rep, failed
	}
	if err != nil {
		return rp.rep, err
	}
	for _, r := range recs {
		if selected[r.Ref] != nil {
			rp.skip(r, "no longer in the topic: retention removed it since the replay started")
		}
	}
	return rp.rep, nil
}

// redriveBytes is a Producer.MaxMessageBytes that lets the redrive of r
// through sarama's own check: its size, with room for its redrive
// headers, below sarama's MaxRequestSize.
func redriveBytes(r *Record, opts ReplayOptions) int {
	n := kafkaRedrive(r, redriveHeaders(r, opts.Now(), opts.By)).ByteSize(2) + 1024
	return min(n, int(sarama.MaxRequestSize)-1)
}

// kafkaRedrive builds the redrive of r: its key, value and original
// headers (in order), then the redrive headers.
func kafkaRedrive(r *Record, redrive []Header) *sarama.ProducerMessage {
	out := &sarama.ProducerMessage{Topic: r.Header(consumer.HeaderOriginalTopic), Partition: -1}
	if p, err := strconv.ParseInt(r.Header(consumer.HeaderOriginalPartition), 10, 32); err == nil && p >= 0 {
		out.Partition = int32(p)
	}
	if r.Key != nil {
		out.Key = sarama.ByteEncoder(r.Key)
	}
	if r.Value != nil {
		out.Value = sarama.ByteEncoder(r.Value)
	}
	raw, _ := r.raw.([]sarama.RecordHeader)
	for _, h := range raw {
		if !diagnosticHeaders[string(h.Key)] {
			out.Headers = append(out.Headers, h)
		}
	}
	for _, h := range redrive {
		out.Headers = append(out.Headers, sarama.RecordHeader{Key: []byte(h.Key), Value: []byte(h.Value)})
	}
	return out
}

// originalPartitioner sends a message to its Partition when it names one
// (>= 0), else where sarama's default hash partitioner sends it.
type originalPartitioner struct {
	hash sarama.Partitioner
}

func newOriginalPartitioner(topic string) sarama.Partitioner {
	return &originalPartitioner{hash: sarama.NewHashPartitioner(topic)}
}

func (p *originalPartitioner) Partition(m *sarama.ProducerMessage, n int32) (int32, error) {
	if m.Partition >= 0 && m.Partition < n {
		return m.Partition, nil
	}
	return p.hash.Partition(m, n)
}

func (p *originalPartitioner) RequiresConsistency() bool { return true }

// orCtx returns ctx's error when ctx has ended (err then comes from a cut
// connection, or from a call the end of ctx stopped), else err.
func orCtx(ctx context.Context, err error) error {
	if err != nil && ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}
