package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel/attribute"
	promexporter "go.opentelemetry.io/otel/exporters/prometheus"
	"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
	"go.opentelemetry.io/otel/metric"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// telemetry holds the service's OpenTelemetry providers and its HTTP
// endpoints: /metrics (Prometheus text format) and /healthz.
type telemetry struct {
	meters  *sdkmetric.MeterProvider
	tracer  trace.TracerProvider
	sdkTP   *sdktrace.TracerProvider
	srv     *http.Server
	addr    string
	running atomic.Bool // the consumer is running: /healthz says so
	pool    atomic.Pointer[pgxpool.Pool]
}

// startTelemetry builds the providers and, when metricsAddr is not empty,
// serves /metrics and /healthz there. traces is where spans go: "" for
// nowhere, "stdout", or a file name.
func startTelemetry(metricsAddr, traces string) (*telemetry, error) {
	res := resource.NewSchemaless(attribute.String("service.name", "order-processor"))
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	exp, err := promexporter.New(promexporter.WithRegisterer(reg))
	if err != nil {
		return nil, err
	}
	t := &telemetry{meters: sdkmetric.NewMeterProvider(sdkmetric.WithReader(exp), sdkmetric.WithResource(res)),
		tracer: noop.NewTracerProvider()}

	if traces != "" {
		var w io.Writer = os.Stdout
		if traces != "stdout" {
			f, err := os.Create(traces)
			if err != nil {
				return nil, err
			}
			w = f
		}
		se, err := stdouttrace.New(stdouttrace.WithWriter(w))
		if err != nil {
			return nil, err
		}
		t.sdkTP = sdktrace.NewTracerProvider(sdktrace.WithBatcher(se), sdktrace.WithResource(res))
		t.tracer = t.sdkTP
	}

	if metricsAddr != "" {
		ln, err := net.Listen("tcp", metricsAddr)
		if err != nil {
			return nil, fmt.Errorf("metrics address: %w", err)
		}
		t.addr = ln.Addr().String()
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		mux.HandleFunc("/healthz", t.healthz)
		t.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
		go func() { _ = t.srv.Serve(ln) }()
	}
	return t, nil
}

// MeterProvider is what the consumer and the Kafka source export through.
func (t *telemetry) MeterProvider() metric.MeterProvider { return t.meters }

// healthz answers 200 while the consumer runs and the database answers a
// ping within a second, 503 otherwise.
func (t *telemetry) healthz(w http.ResponseWriter, r *http.Request) {
	if !t.running.Load() {
		http.Error(w, "consumer not running", http.StatusServiceUnavailable)
		return
	}
	if p := t.pool.Load(); p != nil {
		ctx, cancel := context.WithTimeout(r.Context(), time.Second)
		defer cancel()
		if err := p.Ping(ctx); err != nil {
			http.Error(w, "database unreachable", http.StatusServiceUnavailable)
			return
		}
	}
	_, _ = io.WriteString(w, "ok\n")
}

// Close stops the HTTP server and flushes the spans.
func (t *telemetry) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var errs []error
	if t.srv != nil {
		errs = append(errs, t.srv.Shutdown(ctx))
	}
	if t.sdkTP != nil {
		errs = append(errs, t.sdkTP.Shutdown(ctx))
	}
	errs = append(errs, t.meters.Shutdown(ctx))
	return errors.Join(errs...)
}
