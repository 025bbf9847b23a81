package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/encoding/protodelim"

	"github.com/kvrouter/kvrouter/clients/go/bridge"
	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate/kvtest"
)

// scrapeMetrics reads a /metrics endpoint in Prometheus' protobuf format and returns its families.
// Like the text format, it holds only families with at least one series.
func scrapeMetrics(url string) (map[string]*family, error) {
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Accept", "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	out := map[string]*family{}
	r := bufio.NewReader(resp.Body)
	for {
		var mf dto.MetricFamily
		if err := protodelim.UnmarshalFrom(r, &mf); errors.Is(err, io.EOF) {
			return out, nil
		} else if err != nil {
			return nil, fmt.Errorf("GET %s: %w", url, err)
		}
		f := &family{typ: strings.ToLower(mf.GetType().String()), labels: map[string]bool{}}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				f.labels[l.GetName()] = true
			}
		}
		out[mf.GetName()] = f
	}
}

// bridgeMetrics returns the families `kvrouter bridge` exports: those of a real bridge process
// (dialling router, with no engine behind its endpoint), and every family the bridge package
// registers, from their descriptors, since its labelled families have no series before an engine
// talks.
func bridgeMetrics(t *testing.T, bin, router string) map[string]*family {
	t.Helper()
	metricsAddr := freePort(t)
	cmd := exec.Command(bin, "bridge", "--router-addrs", router, "--engine-endpoint", "tcp://"+freePort(t),
		"--worker-id", "99", "--model", "bridged", "--block-size", "4", "--total-kv-blocks", "64",
		"--worker-endpoint", "10.0.0.1:8000", "--metrics-listen", metricsAddr, "--shutdown-drain", "2s")
	logs := &lockedBuffer{}
	cmd.Stderr = logs
	exit := runUntilCleanup(t, cmd, logs, nil)
	var scraped map[string]*family
	if !kvtest.Poll(defaultTestTimeout, 50*time.Millisecond, func() bool {
		if err, ok := exit.exited(); ok {
			t.Fatalf("kvrouter bridge exited early: %v\n%s", err, logs)
		}
		var err error
		scraped, err = scrapeMetrics("http://" + metricsAddr + "/metrics")
		return err == nil
	}) {
		t.Fatalf("kvrouter bridge's /metrics never answered\n%s", logs)
	}

	// The in-process bridge dials an address nobody listens on, and is stopped at once: only its
	// registrations matter.
	conn, err := grpc.NewClient("passthrough:///"+freePort(t), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	reg := &describingRegisterer{reg: prometheus.NewRegistry(), families: map[string]*family{}}
	b, err := bridge.New(bridge.Options{
		Hello: &kvrouterv1.WorkerHello{Endpoint: "10.0.0.1:8000", WorkerId: 98, Model: "bridged", Role: kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED, BlockSize: 4, TotalKvBlocks: 64},
		Conns: []grpc.ClientConnInterface{conn}, Endpoint: "tcp://" + freePort(t), Registerer: reg,
	})
	if err != nil {
		t.Fatalf("bridge.New = %v", err)
	}
	stopped, stop := context.WithCancel(context.Background())
	stop()
	_ = b.Run(stopped, 0) // stops its publishers; with nothing to flush, its error says nothing
	if len(reg.families) == 0 {
		t.Fatal("the bridge package registered no metrics")
	}
	for name, f := range reg.families {
		scraped[name] = f
	}
	return scraped
}

// describingRegisterer registers collectors and records the families their descriptors name.
type describingRegisterer struct {
	reg      *prometheus.Registry
	families map[string]*family
}

var (
	descName   = regexp.MustCompile(`^Desc\{fqName: "([^"]+)"`)
	descLabels = regexp.MustCompile(`variableLabels: \{([^}]*)\}\}$`)
)

func (d *describingRegisterer) Register(c prometheus.Collector) error {
	typ, err := collectorType(c)
	if err != nil {
		return err
	}
	descs := make(chan *prometheus.Desc)
	go func() {
		c.Describe(descs)
		close(descs)
	}()
	for desc := range descs {
		s := desc.String()
		name, labels := descName.FindStringSubmatch(s), descLabels.FindStringSubmatch(s)
		if name == nil || labels == nil {
			return fmt.Errorf("cannot read descriptor %s", s)
		}
		f := &family{typ: typ, labels: map[string]bool{}}
		for _, l := range strings.Split(labels[1], ",") {
			if l != "" {
				f.labels[strings.TrimSuffix(strings.TrimPrefix(l, "c("), ")")] = true
			}
		}
		d.families[name[1]] = f
	}
	return d.reg.Register(c)
}

func (d *describingRegisterer) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := d.Register(c); err != nil {
			panic(err)
		}
	}
}

func (d *describingRegisterer) Unregister(c prometheus.Collector) bool { return d.reg.Unregister(c) }

// collectorType is the metric type of a collector of one family: from a metric it collects, or,
// for a vector without series yet, from the vector's type.
func collectorType(c prometheus.Collector) (string, error) {
	switch c.(type) {
	case *prometheus.CounterVec:
		return "counter", nil
	case *prometheus.GaugeVec:
		return "gauge", nil
	case *prometheus.HistogramVec:
		return "histogram", nil
	case *prometheus.SummaryVec:
		return "summary", nil
	}
	metrics := make(chan prometheus.Metric, 64)
	go func() {
		c.Collect(metrics)
		close(metrics)
	}()
	typ := ""
	for m := range metrics {
		var pb dto.Metric
		if err := m.Write(&pb); err != nil {
			return "", err
		}
		switch {
		case pb.Counter != nil:
			typ = "counter"
		case pb.Gauge != nil:
			typ = "gauge"
		case pb.Histogram != nil:
			typ = "histogram"
		case pb.Summary != nil:
			typ = "summary"
		default:
			typ = "untyped"
		}
	}
	if typ == "" {
		return "", fmt.Errorf("cannot tell the type of %T: teach collectorType its kind", c)
	}
	return typ, nil
}

// targetLabels are the labels Prometheus adds to every scraped series.
var targetLabels = map[string]bool{"instance": true, "job": true}

// promqlRef is a metric a PromQL expression names, with the labels its matchers use.
type promqlRef struct {
	name   string
	labels []string
}

var (
	promString    = regexp.MustCompile("\"(?:[^\"\\\\]|\\\\.)*\"|'(?:[^'\\\\]|\\\\.)*'|`[^`]*`")
	grafanaVar    = regexp.MustCompile(`\$\{[^}]*\}|\$[A-Za-z_][A-Za-z0-9_]*`)
	promRange     = regexp.MustCompile(`\[[^\]]*\]`)
	promSelector  = regexp.MustCompile(`([A-Za-z_:][A-Za-z0-9_:]*)?\s*\{([^}]*)\}`)
	promMatcher   = regexp.MustCompile(`^([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*""$`)
	promGrouping  = regexp.MustCompile(`\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)`)
	promIdent     = regexp.MustCompile(`[A-Za-z_:][A-Za-z0-9_:]*`)
	promFunctions = setOf(strings.Fields(`
		sum min max avg group stddev stdvar count count_values bottomk topk quantile limitk limit_ratio
		abs absent absent_over_time ceil changes clamp clamp_max clamp_min day_of_month day_of_week day_of_year
		days_in_month delta deriv double_exponential_smoothing exp floor histogram_avg histogram_count
		histogram_fraction histogram_quantile histogram_stddev histogram_stdvar histogram_sum holt_winters hour
		idelta increase info irate label_join label_replace ln log2 log10 minute month predict_linear rate resets
		round scalar sgn sort sort_desc sort_by_label sort_by_label_desc sqrt time timestamp vector year
		avg_over_time min_over_time max_over_time sum_over_time count_over_time quantile_over_time stddev_over_time
		stdvar_over_time last_over_time present_over_time mad_over_time acos acosh asin asinh atan atanh cos cosh
		sin sinh tan tanh deg pi rad start end`))
	promKeywords = setOf(strings.Fields(`by without on ignoring group_left group_right bool and or unless offset inf nan Inf NaN`))
)

// promqlRefs returns the metrics expr names, with their matchers' labels, or what it cannot read:
// an unknown function, a selector without a metric name, a malformed matcher. Grafana's variables
// ($__rate_interval, ${model}) are allowed where PromQL takes a duration or a string.
func promqlRefs(expr string) ([]promqlRef, []string) {
	var problems []string
	s := promString.ReplaceAllString(expr, `""`)
	s = grafanaVar.ReplaceAllString(s, "")
	s = promRange.ReplaceAllString(s, "")
	matchers := map[int][]string{} // selector position -> its labels
	for _, m := range promSelector.FindAllStringSubmatchIndex(s, -1) {
		if m[2] < 0 {
			problems = append(problems, "a selector without a metric name")
			continue
		}
		var labels []string
		for _, part := range strings.Split(s[m[4]:m[5]], ",") {
			if part = strings.TrimSpace(part); part == "" {
				continue
			}
			lm := promMatcher.FindStringSubmatch(part)
			if lm == nil {
				problems = append(problems, fmt.Sprintf("cannot read matcher %q", part))
				continue
			}
			labels = append(labels, lm[1])
		}
		matchers[m[2]] = labels
	}
	// Blank the matchers and grouping clauses (keeping offsets), so what is left names metrics,
	// functions and keywords.
	blank := func(re *regexp.Regexp, from int, s string) string {
		b := []byte(s)
		for _, m := range re.FindAllStringSubmatchIndex(s, -1) {
			for i := m[from]; i < m[1]; i++ {
				b[i] = ' '
			}
		}
		return string(b)
	}
	s = blank(regexp.MustCompile(`\{[^}]*\}`), 0, s)
	s = blank(promGrouping, 0, s)
	var refs []promqlRef
	for _, m := range promIdent.FindAllStringIndex(s, -1) {
		word := s[m[0]:m[1]]
		if m[0] > 0 && strings.ContainsRune("0123456789.", rune(s[m[0]-1])) {
			continue // a number's exponent or a duration's unit
		}
		if strings.HasPrefix(strings.TrimLeft(s[m[1]:], " \t\n"), "(") {
			if !promFunctions[word] {
				problems = append(problems, fmt.Sprintf("unknown function %s", word))
			}
			continue
		}
		if promKeywords[word] {
			continue
		}
		refs = append(refs, promqlRef{name: word, labels: matchers[m[0]]})
	}
	return refs, problems
}

// familyOf is the exported family a metric name belongs to: itself, or the histogram or summary
// whose _bucket, _sum or _count series it is ("" when none).
func familyOf(name string, exported map[string]*family) string {
	if exported[name] != nil {
		return name
	}
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		base, ok := strings.CutSuffix(name, suffix)
		if f := exported[base]; ok && f != nil && (f.typ == "histogram" || (f.typ == "summary" && suffix != "_bucket")) {
			return base
		}
	}
	return ""
}

// checkPromQL returns what is wrong with expr: metrics no process exports, labels their family
// lacks, unknown functions.
func checkPromQL(expr string, exported map[string]*family) []string {
	refs, problems := promqlRefs(expr)
	if len(refs) == 0 {
		problems = append(problems, "names no metric")
	}
	for _, r := range refs {
		fam := familyOf(r.name, exported)
		if fam == "" {
			problems = append(problems, fmt.Sprintf("%s is not a metric the service exports", r.name))
			continue
		}
		for _, l := range r.labels {
			if !exported[fam].labels[l] && !targetLabels[l] && (l != "le" || !strings.HasSuffix(r.name, "_bucket")) {
				problems = append(problems, fmt.Sprintf("%s has no label %s", r.name, l))
			}
		}
	}
	return problems
}

// TestPromQLRefs: the PromQL reader finds the metrics and matcher labels of the expressions the
// page and the dashboard use, and refuses what it cannot read.
func TestPromQLRefs(t *testing.T) {
	tests := []struct {
		expr     string
		want     []promqlRef
		problems []string
	}{
		{`histogram_quantile(0.99, sum by (le) (rate(grpc_server_handling_seconds_bucket{grpc_service="kvrouter.v1.RouterService", grpc_method="Route"}[$__rate_interval])))`,
			[]promqlRef{{"grpc_server_handling_seconds_bucket", []string{"grpc_service", "grpc_method"}}}, nil},
		{`sum by (model) (rate(kvrouter_route_decisions_total{mode="bypass",model=~"${model}"}[5m])) / sum by (model) (rate(kvrouter_route_decisions_total{mode=~"bypass|disaggregated"}[5m]))`,
			[]promqlRef{{"kvrouter_route_decisions_total", []string{"mode", "model"}}, {"kvrouter_route_decisions_total", []string{"mode"}}}, nil},
		{`(min by (instance) (kvrouter_tls_certificate_expiry_timestamp_seconds) - time()) / 86400 < 14`,
			[]promqlRef{{"kvrouter_tls_certificate_expiry_timestamp_seconds", nil}}, nil},
		{`max(kvrouter_shared_log_degraded) == bool 1 and on (instance) kvrouter_log_position offset 5m > 1e3`,
			[]promqlRef{{"kvrouter_shared_log_degraded", nil}, {"kvrouter_log_position", nil}}, nil},
		{`sum(rate(kvrouter_kv_events_total{outcome!~"applied|duplicate"}[5m])) by (outcome) > 0`,
			[]promqlRef{{"kvrouter_kv_events_total", []string{"outcome"}}}, nil},
		{`rat(kvrouter_bookings)`, []promqlRef{{"kvrouter_bookings", nil}}, []string{"unknown function rat"}},
		{`{__name__="kvrouter_bookings"}`, nil, []string{"a selector without a metric name"}},
	}
	for _, tt := range tests {
		got, problems := promqlRefs(tt.expr)
		if diff := cmp.Diff(tt.want, got, cmp.AllowUnexported(promqlRef{})); diff != "" {
			t.Errorf("promqlRefs(%s) refs (-want +got):\n%s", tt.expr, diff)
		}
		if !slices.Equal(problems, tt.problems) {
			t.Errorf("promqlRefs(%s) problems = %q, want %q", tt.expr, problems, tt.problems)
		}
	}

	exported := map[string]*family{
		"kvrouter_route_decision_seconds": {typ: "histogram", labels: map[string]bool{}},
		"go_gc_duration_seconds":          {typ: "summary", labels: map[string]bool{}},
		"kvrouter_workers":                {typ: "gauge", labels: map[string]bool{"model": true, "role": true, "connected": true}},
	}
	checks := []struct {
		expr string
		want []string
	}{
		{`histogram_quantile(0.5, sum by (le, instance) (rate(kvrouter_route_decision_seconds_bucket{le!="+Inf"}[1m])))`, nil},
		{`rate(go_gc_duration_seconds_sum[1m]) / rate(go_gc_duration_seconds_count[1m])`, nil},
		{`go_gc_duration_seconds_bucket`, []string{"go_gc_duration_seconds_bucket is not a metric the service exports"}},
		{`sum by (role) (kvrouter_workers{connected="true", job="kvrouter"})`, nil},
		{`kvrouter_workers{rol="decode"}`, []string{"kvrouter_workers has no label rol"}},
		{`sum(kvrouter_bogus_total)`, []string{"kvrouter_bogus_total is not a metric the service exports"}},
		{`vector(1)`, []string{"names no metric"}},
	}
	for _, c := range checks {
		if got := checkPromQL(c.expr, exported); !slices.Equal(got, c.want) {
			t.Errorf("checkPromQL(%s) = %q, want %q", c.expr, got, c.want)
		}
	}
}
